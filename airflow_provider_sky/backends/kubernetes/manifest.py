"""Pod manifests of a cluster, as plain dicts (the API accepts them as they are): no I/O, unit-tested.

One pod per node, ``<cluster>-head`` and ``<cluster>-worker<i>``, labelled with the cluster and the role;
``restartPolicy: Never``; no service-account token unless the connection names a service account; an entrypoint that idles and exits 0 on SIGTERM, or becomes the node agent
(the ranks are started later through exec or the agent); ``/dev/shm`` memory-backed (PyTorch's data loaders and NCCL need more than the runtime's
64 MiB default). Spreading, resources and GPUs follow SkyPilot's Kubernetes provisioner.
"""

from __future__ import annotations

import copy
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.spec import TaskSpec
from airflow_provider_sky.spec.config import merge_patch

CLUSTER_LABEL = "sky.airflow/cluster"
ROLE_LABEL = "sky.airflow/role"
NAME_ANNOTATION = "sky.airflow/cluster-name"
ACCELERATOR_ANNOTATION = "sky.airflow/accelerators"
CONTAINER = "node"
HOSTNAME_TOPOLOGY = "kubernetes.io/hostname"
#: idles until SIGTERM, then exits 0 (``sleep`` in the background so the trap runs at once); once the
#: provisioning exec wrote the node agent's ``run.sh`` and woke it (SIGUSR1), it becomes the agent
#: (``agents.py``; an image without ``python3`` gets no ``run.sh`` and idles on)
ENTRYPOINT = [
    "/bin/sh",
    "-c",
    "trap 'exit 0' TERM INT; trap : USR1; a=\"${HOME:-/root}/.sky_agent/run.sh\"; "
    'while :; do [ -f "$a" ] && exec /bin/sh "$a"; sleep 3600 & wait $!; kill $! 2>/dev/null; done',
]
ANTI_AFFINITY = ("soft", "hard", "off")

_DNS_BAD = re.compile(r"[^a-z0-9-]+")


def dns_name(name: str, limit: int = 63) -> str:
    """``name`` as a DNS-1123 label (lowercase alphanumerics and '-', alphanumeric at both ends, at most
    ``limit`` characters); a name that had to be changed or cut gets a short hash, so two names never meet."""
    clean = _DNS_BAD.sub("-", name.lower()).strip("-") or "sky"
    if clean == name and len(clean) <= limit:
        return clean
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{clean[: limit - 7].rstrip('-')}-{digest}"


#: room left in a 63-character name for ``-worker<i>`` (up to 9,999 workers)
_BASE_LIMIT = 63 - len("-worker9999")


def pod_names(cluster: str, num_nodes: int) -> list[str]:
    """``<cluster>-head``, ``<cluster>-worker1`` ... (names of at most 63 characters; the head's name
    does not depend on the node count, so the cluster's record is found from its name alone)."""
    base = dns_name(cluster, _BASE_LIMIT)
    return [f"{base}-head"] + [f"{base}-worker{i}" for i in range(1, num_nodes)]


def head_name(cluster: str) -> str:
    return pod_names(cluster, 1)[0]


def cluster_selector(cluster: str) -> str:
    return f"{CLUSTER_LABEL}={dns_name(cluster)}"


def quantity(value: str, unit: str = "") -> tuple[str, bool]:
    """A SkyPilot quantity (``4``, ``4+``, ``0.5``) → (Kubernetes quantity, exact). ``4`` is exactly 4
    (request and limit), ``4+`` at least 4 (request only)."""
    exact = not value.endswith("+")
    number = float(value.rstrip("+"))
    text = f"{number:g}" if unit == "" else f"{number:g}{unit}"
    return text, exact


@dataclass(frozen=True)
class PodOptions:
    """The connection's say over the pods (see ``config.KubeSettings``)."""

    image: str
    image_pull_policy: str | None = None
    anti_affinity: str = "soft"
    gpu_resource: str = "nvidia.com/gpu"
    accelerator_label: str = "skypilot.co/accelerator"
    service_account: str | None = None
    #: a pod ``affinity`` the user gives; the anti-affinity is merged into it
    affinity: Mapping[str, Any] = field(default_factory=dict)


def image_for(spec: TaskSpec, default: str) -> str:
    """``resources.image_id`` in SkyPilot's ``docker:<image>`` form, else the connection's image."""
    image = spec.resources.image_id
    if image:
        return image[len("docker:") :] if image.startswith("docker:") else image
    return default


def resources(spec: TaskSpec, opts: PodOptions) -> dict[str, dict[str, str]]:
    """Requests and limits from ``cpus``, ``memory`` (GiB) and whole GPUs (a fraction rounds up)."""
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    res = spec.resources
    for key, value, unit in (("cpu", res.cpus, ""), ("memory", res.memory, "Gi")):
        if value:
            text, exact = quantity(value, unit)
            requests[key] = text
            if exact:
                limits[key] = text
    if res.accelerators:
        count = str(res.accelerators.gpus_per_node)
        requests[opts.gpu_resource] = count  # extended resources: request == limit
        limits[opts.gpu_resource] = count
    out: dict[str, dict[str, str]] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def affinity(cluster: str, num_nodes: int, opts: PodOptions) -> dict[str, Any]:
    """The user's affinity with the cluster's pod anti-affinity on ``kubernetes.io/hostname`` merged in:
    ``soft`` prefers one pod per machine (weight 100), ``hard`` requires it, ``off`` adds nothing."""
    merged: dict[str, Any] = copy.deepcopy(dict(opts.affinity))
    if num_nodes <= 1 or opts.anti_affinity == "off":
        return merged
    term = {
        "labelSelector": {"matchLabels": {CLUSTER_LABEL: dns_name(cluster)}},
        "topologyKey": HOSTNAME_TOPOLOGY,
    }
    anti = merged.setdefault("podAntiAffinity", {})
    if opts.anti_affinity == "hard":
        anti.setdefault("requiredDuringSchedulingIgnoredDuringExecution", []).append(term)
    else:
        anti.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {"weight": 100, "podAffinityTerm": term}
        )
    return merged


def pod_manifest(cluster: str, index: int, spec: TaskSpec, opts: PodOptions) -> dict[str, Any]:
    """Node ``index`` (0 is the head) of ``cluster``."""
    name = pod_names(cluster, spec.num_nodes)[index]
    labels = {
        **spec.resources.labels,
        CLUSTER_LABEL: dns_name(cluster),
        ROLE_LABEL: "head" if index == 0 else "worker",
    }
    annotations = {NAME_ANNOTATION: cluster}
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": image_for(spec, opts.image),
        "command": ENTRYPOINT,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if opts.image_pull_policy:
        container["imagePullPolicy"] = opts.image_pull_policy
    res = resources(spec, opts)
    if res:
        container["resources"] = res
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 10,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    # SkyPilot's volumes: the PersistentVolumeClaim of each name, mounted in every pod
    for i, (path, claim) in enumerate(sorted(spec.volumes.items())):
        pod_spec["volumes"].append({"name": f"sky-volume-{i}", "persistentVolumeClaim": {"claimName": claim}})
        container["volumeMounts"].append({"name": f"sky-volume-{i}", "mountPath": path})
    acc = spec.resources.accelerators
    if acc:
        # what the user wrote (V100:0.5) stays visible; the scheduler is asked for whole units
        annotations[ACCELERATOR_ANNOTATION] = f"{acc.name}:{acc.count:g}"
        pod_spec["nodeSelector"] = {opts.accelerator_label: acc.name.lower()}
        pod_spec["tolerations"] = [{"key": opts.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
    aff = affinity(cluster, spec.num_nodes, opts)
    if aff:
        pod_spec["affinity"] = aff
    if opts.service_account:  # the task asks for an identity in the cluster: its token is mounted
        pod_spec["serviceAccountName"] = opts.service_account
    else:  # else no API token in the pods, where every rank's code could read it
        pod_spec["automountServiceAccountToken"] = False
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": pod_spec,
    }
    # SkyPilot's config.kubernetes.pod_config (and docker.run_options), merged as SkyPilot merges it;
    # what the backend owns was refused before provisioning (owned_problems)
    return merge_patch(pod, spec.pod_config) if spec.pod_config else pod


#: at most this many ports in one Service (a range counts each of its ports)
MAX_SERVICE_PORTS = 100


def port_numbers(ports: tuple[str, ...]) -> list[int]:
    """SkyPilot's ``ports`` (``"8080"``, ``"10000-10010"``) as the port numbers, in order, once each."""
    out: list[int] = []
    for port in ports:
        low, _, high = str(port).partition("-")
        for number in range(int(low), int(high or low) + 1):
            if number not in out:
                out.append(number)
    return out


def service_manifest(cluster: str, ports: list[int], head_uid: str) -> dict[str, Any]:
    """The cluster's Service: the head pod's ``ports`` at a stable name, ``<head pod>.<namespace>.svc``.
    Owned by the head pod, so Kubernetes deletes it with the pod (teardown, or a failed provision)."""
    head = head_name(cluster)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": head,
            "labels": {CLUSTER_LABEL: dns_name(cluster)},
            "annotations": {NAME_ANNOTATION: cluster},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": head, "uid": head_uid}],
        },
        "spec": {
            "type": "ClusterIP",
            "selector": {CLUSTER_LABEL: dns_name(cluster), ROLE_LABEL: "head"},
            "ports": [{"name": f"port-{p}", "port": p, "targetPort": p, "protocol": "TCP"} for p in ports],
        },
    }


#: (path in the pod, why) for what the backend sets and a pod_config may not change
_OWNED: tuple[tuple[tuple[str | int, ...], str], ...] = (
    (("apiVersion",), "the backend makes v1 Pods"),
    (("kind",), "the backend makes v1 Pods"),
    (("metadata", "name"), "the backend names the pods after the cluster (head, worker1, ...)"),
    (("metadata", "namespace"), "the connection's namespace is where the pods go"),
    (("metadata", "labels", CLUSTER_LABEL), "the backend finds its pods by it"),
    (("metadata", "labels", ROLE_LABEL), "the backend finds its pods by it"),
    (("metadata", "annotations", NAME_ANNOTATION), "the backend finds its clusters by it"),
    (("spec", "restartPolicy"), "a rank that exits must not be restarted behind the gang's back"),
    (("spec", "containers", 0, "name"), "the backend runs the ranks in it by name"),
    (("spec", "containers", 0, "command"), "it is the node's entrypoint (its keeper)"),
    (("spec", "containers", 0, "args"), "it would change the node's entrypoint (its keeper)"),
    (("spec", "containers", 0, "image"), "set the image with resources.image_id (docker:IMAGE)"),
)


def owned_problems(patch: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, why) for each part of a pod_config the backend owns: refused before provisioning."""
    problems = []
    for path, why in _OWNED:
        node: Any = patch
        for step in path:
            if isinstance(step, int):
                node = node[step] if isinstance(node, list) and len(node) > step else None
            else:
                node = node.get(step) if isinstance(node, dict) else None
            if node is None:
                break
        if node is not None:
            shown = ".".join(f"[{p}]" if isinstance(p, int) else p for p in path).replace(".[", "[")
            problems.append(
                (
                    f"config.kubernetes.pod_config.{shown}",
                    f"is the kubernetes backend's own and cannot be set: {why}; remove it",
                )
            )
    return problems
