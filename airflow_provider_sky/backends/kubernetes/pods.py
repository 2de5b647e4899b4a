"""What a pod's status says, in words: why it is not running yet, and whether waiting can help.

Pending has two clocks (SkyPilot, cncf.kubernetes do the same): until the scheduler places the pod, then
until its container starts. Image errors cannot heal by waiting and fail at once; a pod the scheduler
cannot place fails with the scheduler's own words (``0/2 nodes are available: 2 Insufficient
nvidia.com/gpu``) once it has said so for ``UNSCHEDULABLE_GRACE`` seconds (other pods of ours may still be
going away); the rest is waited for up to the provision timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from airflow_provider_sky.backends.kubernetes.manifest import NAME_ANNOTATION, ROLE_LABEL

#: the values of our role label
ROLES = frozenset({"head", "worker"})

#: container waiting reasons that waiting does not cure
FATAL_WAITING = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
UNSCHEDULABLE_GRACE = 10.0


@dataclass(frozen=True)
class PodState:
    """One pod as provisioning sees it."""

    name: str
    phase: str
    ip: str | None
    node: str | None
    #: why it is not running, in words ("" when running)
    reason: str = ""
    #: waiting cannot help (a bad image, a failed container)
    fatal: bool = False
    #: the scheduler said it cannot place the pod
    unschedulable: bool = False
    deleting: bool = False
    #: the full cluster name the pod was made for (annotation ``sky.airflow/cluster-name``)
    owner: str | None = None
    #: our role label (``head``, ``worker``), None when the pod has none
    role: str | None = None

    @property
    def running(self) -> bool:
        return self.phase == "Running" and bool(self.ip) and not self.deleting

    def ours(self, cluster: str) -> bool:
        """Made by us for ``cluster``: its full-name annotation is ``cluster`` and it has our role label.
        Our cluster label alone is not enough (a user's pod may carry it; two names may share it)."""
        return self.owner == cluster and self.role in ROLES

    def whose(self) -> str:
        """Who the pod belongs to, for messages."""
        if self.owner and self.role in ROLES:
            return f"it belongs to cluster {self.owner!r}"
        annotation = (
            f"annotation {NAME_ANNOTATION}={self.owner}" if self.owner else f"no {NAME_ANNOTATION} annotation"
        )
        label = f"label {ROLE_LABEL}={self.role}" if self.role else f"no {ROLE_LABEL} label"
        return f"it is not a pod this provider made ({annotation}, {label})"


def _get(obj: Any, *path: str) -> Any:
    for key in path:
        if obj is None:
            return None
        obj = getattr(obj, key, None)
    return obj


def pod_state(pod: Any) -> PodState:
    """Read a ``V1Pod``."""
    name = _get(pod, "metadata", "name") or "?"
    phase = _get(pod, "status", "phase") or "Pending"
    common = {
        "name": name,
        "phase": phase,
        "ip": _get(pod, "status", "pod_ip"),
        "node": _get(pod, "spec", "node_name"),
        "deleting": _get(pod, "metadata", "deletion_timestamp") is not None,
        "owner": (_get(pod, "metadata", "annotations") or {}).get(NAME_ANNOTATION),
        "role": (_get(pod, "metadata", "labels") or {}).get(ROLE_LABEL),
    }
    image = ""
    containers = _get(pod, "spec", "containers") or []
    if containers:
        image = getattr(containers[0], "image", "") or ""
    for cs in _get(pod, "status", "container_statuses") or []:
        waiting = _get(cs, "state", "waiting")
        if waiting is not None and waiting.reason in FATAL_WAITING:
            detail = f": {waiting.message}" if waiting.message else ""
            return PodState(**common, reason=f"{waiting.reason} for image {image!r}{detail}", fatal=True)
        terminated = _get(cs, "state", "terminated")
        if terminated is not None:
            why = terminated.reason or "Error"
            return PodState(
                **common,
                reason=f"the pod's container ended ({why}, exit code {terminated.exit_code})",
                fatal=True,
            )
    if phase in ("Failed", "Succeeded"):
        reason = _get(pod, "status", "reason") or phase
        message = _get(pod, "status", "message") or ""
        return PodState(**common, reason=f"the pod {phase.lower()}: {reason} {message}".strip(), fatal=True)
    for cond in _get(pod, "status", "conditions") or []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return PodState(
                **common, reason=cond.message or cond.reason or "not scheduled", unschedulable=True
            )
    if phase != "Running":
        return PodState(
            **common, reason="scheduled, container not started yet" if common["node"] else "pending"
        )
    return PodState(**common)
