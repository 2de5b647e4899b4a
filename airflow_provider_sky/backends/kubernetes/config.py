"""A ``sky_kubernetes`` connection read into settings: one plain function, no client library, tested as a
matrix. Exactly one source of cluster credentials: ``in_cluster``, ``kube_config`` (the file's content),
``kube_config_path``, or none of them (``$KUBECONFIG``, else ``~/.kube/config``); two given is an error.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.kubernetes.manifest import ANTI_AFFINITY, PodOptions, dns_name
from airflow_provider_sky.backends.ssh.config import name_value

DEFAULT_IMAGE = "busybox:latest"
DEFAULT_PROVISION_TIMEOUT = 300.0
PULL_POLICIES = ("Always", "IfNotPresent", "Never")


@dataclass(frozen=True)
class KubeSettings:
    """Where the API server is and how the pods look."""

    #: "in_cluster", "content", "path" or "default"
    source: str = "default"
    kube_config: Mapping[str, Any] | None = field(default=None, repr=False)
    kube_config_path: str | None = None
    context: str | None = None
    namespace: str = "default"
    provision_timeout: float = DEFAULT_PROVISION_TIMEOUT
    verify_ssl: bool = True
    pods: PodOptions = field(default_factory=lambda: PodOptions(image=DEFAULT_IMAGE))
    #: start node agents where the image has python3 (``agents.py``); off: the per-node path only
    node_agent: bool = True


def _flag(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key)
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)


def _kube_config_content(raw: Any) -> Mapping[str, Any]:
    """The kubeconfig given as text (YAML or JSON) or as a mapping; kept in memory, never written out."""
    if isinstance(raw, Mapping):
        return raw
    try:
        data = yaml.safe_load(str(raw))
    except yaml.YAMLError as exc:
        raise BackendError(f"kube_config: not a kubeconfig (YAML/JSON): {exc}") from None
    if not isinstance(data, Mapping) or "clusters" not in data:
        raise BackendError("kube_config: not a kubeconfig (no 'clusters'); paste the whole file's content")
    return data


def parse_kube_config(config: Mapping[str, Any]) -> KubeSettings:
    """Settings from a ``sky_kubernetes`` connection's extras (a linked ``kubernetes`` one merged in)."""
    sources = [
        name
        for name, given in (
            ("in_cluster", _flag(config, "in_cluster")),
            ("kube_config", bool(config.get("kube_config"))),
            ("kube_config_path", bool(config.get("kube_config_path"))),
        )
        if given
    ]
    if len(sources) > 1:
        raise BackendError(
            f"{' and '.join(sources)}: two sources of cluster credentials; keep one (in_cluster, "
            "kube_config or kube_config_path; none means $KUBECONFIG or ~/.kube/config)"
        )
    source = {"in_cluster": "in_cluster", "kube_config": "content", "kube_config_path": "path"}.get(
        sources[0] if sources else "", "default"
    )
    anti = str(config.get("anti_affinity") or "soft").lower()
    if anti not in ANTI_AFFINITY:
        raise BackendError(f"anti_affinity: {anti!r} is not one of soft (default), hard, off")
    pull = config.get("image_pull_policy") or None
    if pull is not None and pull not in PULL_POLICIES:
        raise BackendError(f"image_pull_policy: {pull!r} is not one of {', '.join(PULL_POLICIES)}")
    namespace = str(config.get("namespace") or "default")
    if dns_name(namespace) != namespace:
        raise BackendError(f"namespace: {namespace!r} is not a valid namespace name (lowercase, digits, '-')")
    timeout = config.get("provision_timeout")
    try:
        provision_timeout = float(timeout) if timeout not in (None, "") else DEFAULT_PROVISION_TIMEOUT
    except (TypeError, ValueError):
        raise BackendError(f"provision_timeout: {timeout!r} is not a number of seconds") from None
    if provision_timeout <= 0:
        raise BackendError(f"provision_timeout: must be positive, got {timeout!r}")
    affinity = config.get("affinity") or {}
    if isinstance(affinity, str):
        affinity = json.loads(affinity)
    return KubeSettings(
        source=source,
        kube_config=_kube_config_content(config["kube_config"]) if source == "content" else None,
        kube_config_path=str(config["kube_config_path"]) if source == "path" else None,
        context=name_value(config.get("context"), "context"),
        namespace=namespace,
        provision_timeout=provision_timeout,
        verify_ssl=not _flag(config, "disable_verify_ssl"),
        node_agent=config.get("node_agent") in (None, "") or _flag(config, "node_agent"),
        pods=PodOptions(
            image=name_value(config.get("image"), "image") or DEFAULT_IMAGE,
            image_pull_policy=pull,
            anti_affinity=anti,
            gpu_resource=name_value(config.get("gpu_resource"), "gpu_resource") or "nvidia.com/gpu",
            accelerator_label=name_value(config.get("accelerator_label"), "accelerator_label")
            or "skypilot.co/accelerator",
            service_account=name_value(config.get("service_account"), "service_account"),
            affinity=affinity,
        ),
    )


#: a ``kubernetes`` (cncf) connection's extras → ours (its ``cluster_context`` is our ``context``)
_CNCF_FIELDS = {
    "in_cluster": "in_cluster",
    "kube_config_path": "kube_config_path",
    "kube_config": "kube_config",
    "namespace": "namespace",
    "cluster_context": "context",
    "disable_verify_ssl": "disable_verify_ssl",
}
_SOURCES = ("in_cluster", "kube_config", "kube_config_path")


def _cncf_field(extras: Mapping[str, Any], name: str) -> Any:
    """Read as the cncf.kubernetes provider reads its extras: the plain name, else ``extra__kubernetes__``."""
    value = extras.get(name)
    if value in (None, ""):
        value = extras.get(f"extra__kubernetes__{name}")
    return None if value in (None, "") else value


def merge_kubernetes_connection(config: Mapping[str, Any], conn: Any) -> dict[str, Any]:
    """Fill what a ``sky_kubernetes`` connection leaves empty from a cncf ``kubernetes`` connection.

    The credentials are taken as a whole from one of the two: ours if we give any source, else theirs.
    """
    extras = dict(conn.extra_dejson)
    theirs = {ours: _cncf_field(extras, name) for name, ours in _CNCF_FIELDS.items()}
    if any(config.get(k) not in (None, "", False) for k in _SOURCES):
        for k in (*_SOURCES, "context", "disable_verify_ssl"):
            theirs.pop(k, None)
    merged = {k: v for k, v in theirs.items() if v is not None}
    merged.update({k: v for k, v in config.items() if v not in (None, "")})
    return merged
