"""What every backend provides: provision, find and terminate N nodes, and a runner per node.

A backend never imports Airflow: it is configured from a plain dict (a connection's extras).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from airflow_provider_sky.runners.base import CommandRunner
from airflow_provider_sky.spec import BackendCapabilities, TaskSpec


class BackendError(Exception):
    """Provisioning or teardown failed; the message says what and how to fix it."""


@dataclass(frozen=True)
class Node:
    """One node of a cluster. ``root`` is the runtime directory on the node (job dirs live under it)."""

    ip: str
    node_id: str
    root: str
    home: str = "~"
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClusterHandle:
    """A provisioned cluster, nodes in rank order (head first). JSON-serialisable for XCom."""

    name: str
    backend: str
    nodes: tuple[Node, ...]
    cloud: str
    region: str | None = None
    zone: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def ips(self) -> list[str]:
        return [n.ip for n in self.nodes]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["nodes"] = [asdict(n) for n in self.nodes]
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterHandle:
        nodes = tuple(Node(**{**n, "extra": dict(n.get("extra") or {})}) for n in data["nodes"])
        return cls(
            name=data["name"],
            backend=data["backend"],
            nodes=nodes,
            cloud=data["cloud"],
            region=data.get("region"),
            zone=data.get("zone"),
            extra=dict(data.get("extra") or {}),
        )


class Backend(ABC):
    """Provision / find / terminate; hand out runners. Implementations keep the rank order stable."""

    kind: str
    capabilities: BackendCapabilities

    @abstractmethod
    def provision(self, name: str, spec: TaskSpec) -> ClusterHandle:
        """Create the cluster, or reuse one of the same name with the same node count."""

    @abstractmethod
    def find(self, name: str) -> ClusterHandle | None:
        """The cluster of that name, if this backend has it."""

    @abstractmethod
    def runner(self, node: Node) -> CommandRunner:
        """A command runner for one node of a cluster of this backend."""

    @abstractmethod
    def terminate(self, name: str, grace: float = 2.0) -> bool:
        """Kill every process the cluster started and release it. Idempotent: False if absent."""

    def sync_files(self, handle: ClusterHandle, spec: TaskSpec) -> None:  # noqa: B027 - optional
        """Copy ``workdir`` and local ``file_mounts`` to every node before setup."""

    def workdir(self, node: Node, spec: TaskSpec) -> str:
        """Where setup and run execute on a node: ``~/sky_workdir`` when a workdir is synced."""
        return f"{node.home}/sky_workdir" if spec.workdir else node.home

    def close(self) -> None:  # noqa: B027 - optional
        """Drop connections held by runners."""
