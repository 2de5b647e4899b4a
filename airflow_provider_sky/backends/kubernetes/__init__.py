"""Gangs on Kubernetes: one pod per node, commands through exec (see ``backend.py``). Registered here;
the backend (and the kubernetes client) is imported on first use."""

from __future__ import annotations

from typing import Any

from airflow_provider_sky.backends.registry import BackendInfo

_STR = {"type": ["string", "null"]}

BACKEND = BackendInfo(
    kind="kubernetes",
    conn_type="skykubernetes",
    former_conn_types=("sky_kubernetes",),
    hook_name="Sky Kubernetes cluster",
    hook_class_name="SkyKubernetesHook",
    factory="airflow_provider_sky.backends.kubernetes.backend:KubernetesBackend",
    default_conn_id="sky_kubernetes_default",
    conn_fields={
        "kubernetes_conn_id": {
            "label": "Reuse a kubernetes connection",
            "description": "Take the cluster credentials, context and namespace from this cncf.kubernetes connection",
            "schema": _STR,
        },
        "kube_config_path": {"label": "Kube config path", "description": "On the workers", "schema": _STR},
        "kube_config": {
            "label": "Kube config (content)",
            "description": "The kubeconfig file's content (YAML or JSON), read in memory",
            "schema": {"type": ["string", "null"], "format": "password"},
        },
        "context": {
            "label": "Context",
            "description": "Default: the kubeconfig's current context",
            "schema": _STR,
        },
        "namespace": {"label": "Namespace", "schema": {"type": ["string", "null"], "default": "default"}},
        "in_cluster": {
            "label": "In cluster",
            "description": "Use the service account of the pod Airflow runs in",
            "schema": {"type": ["boolean", "null"], "default": False},
        },
        "image": {
            "label": "Default image",
            "description": "Unless the task gives image_id: docker:<image>",
            "schema": _STR,
        },
        "image_pull_policy": {
            "label": "Image pull policy",
            "schema": {"type": ["string", "null"], "enum": ["Always", "IfNotPresent", "Never", None]},
        },
        "anti_affinity": {
            "label": "Spread pods over machines",
            "description": "soft (prefer one pod per machine), hard (require it), off",
            "schema": {"type": "string", "enum": ["soft", "hard", "off"], "default": "soft"},
        },
        "gpu_resource": {
            "label": "GPU resource name",
            "schema": {"type": ["string", "null"], "default": "nvidia.com/gpu"},
        },
        "accelerator_label": {
            "label": "GPU type node label",
            "schema": {"type": ["string", "null"], "default": "skypilot.co/accelerator"},
        },
        "service_account": {"label": "Service account of the pods", "schema": _STR},
        "provision_timeout": {
            "label": "Provision timeout (s)",
            "schema": {"type": ["number", "null"], "default": 300},
        },
        "node_agent": {
            "label": "Node agents",
            "description": "Run a node agent as each pod's process when its image has python3: the gang's "
            "fail-fast and status then live on its head pod (off: every pod is polled and cancelled by exec)",
            "schema": {"type": ["boolean", "null"], "default": True},
        },
    },
    extra_aliases=("affinity", "disable_verify_ssl"),
    linked_conn=(
        "kubernetes_conn_id",
        "airflow_provider_sky.backends.kubernetes.config:merge_kubernetes_connection",
    ),
)


def __getattr__(name: str) -> Any:
    """``from airflow_provider_sky.backends.kubernetes import KubernetesBackend`` without the client up front."""
    if name == "KubernetesBackend":
        from airflow_provider_sky.backends.kubernetes import backend

        return backend.KubernetesBackend
    raise AttributeError(name)
