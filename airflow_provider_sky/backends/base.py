"""What every backend provides: provision, find and terminate N nodes, and a runner per node.

A backend never imports Airflow: it is configured from a plain dict (a connection's extras).

A cluster's record is its handle (``ClusterHandle.to_dict()``) plus who uses it and what is left to clean:

* ``leases``: ``{holder id: {"holder": ..., "since": ...}}``. Runs sharing a cluster (one ``cluster_name``)
  each hold a lease; a teardown releases its own and removes the cluster only when no other remains, so
  the short run's teardown never removes the cluster under the long run.
* ``down``: set while a teardown runs; a provision of that name waits for it to end, then starts afresh.
* ``unclean``: ``{node id: why}`` for nodes a teardown could not clean (they did not answer). The record
  stays, naming them, and the next teardown cleans only those.

The functions below change a record (a plain dict); each backend applies them under its own lock.
"""

from __future__ import annotations

import copy
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from airflow_provider_sky.runners.base import CommandRunner, RunnerError
from airflow_provider_sky.spec import BackendCapabilities, SpecError, TaskSpec

_T = TypeVar("_T")
#: nodes copied to at once by ``sync_files``
SYNC_PARALLEL = 16


class BackendError(Exception):
    """Provisioning or teardown failed; the message says what and how to fix it."""


class ClusterBusy(BackendError):
    """The cluster is being torn down; a provision of that name waits for the teardown to end."""


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


@dataclass(frozen=True)
class Teardown:
    """What :meth:`Backend.terminate` did.

    ``removed``: every node was cleaned and the cluster is gone. ``kept_for``: other holders (runs, as
    ``<dag_id>/<run_id>``) still hold leases, so nothing was killed. ``unclean``: nodes that could not be
    cleaned (``"<ip>: <why>"``); the record stays and the next terminate cleans only those. All empty:
    there was no such cluster.
    """

    removed: bool
    kept_for: tuple[str, ...] = ()
    unclean: tuple[str, ...] = ()


class Backend(ABC):
    """Provision / find / terminate; hand out runners. Implementations keep the rank order stable."""

    kind: str
    capabilities: BackendCapabilities
    #: seconds a provision waits for a teardown of the same cluster name to end before it gives up
    busy_wait: float = 120.0
    #: every node is on this one machine: one node-side keeper guards them all
    shared_machine: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Backend:
        """Build the backend from a connection's fields and extras (a plain dict); a wrong or
        contradictory setting raises :class:`BackendError` naming the field and the fix."""
        raise NotImplementedError(f"{cls.__name__} does not read connections")

    @abstractmethod
    def test_connection(self) -> str:
        """Reach every node (or the API) and check the credentials, running nothing on a node: what the
        connection form's Test button says. Raise :class:`BackendError` naming what failed."""

    def machine_of(self, node: Node) -> str:
        """Which machine (and transport) ``node`` is on: nodes of one machine are polled and cancelled
        in one remote call, not one call per node (1,024 local nodes cost 1,024 ``sh`` per poll).

        Default: every node its own machine, or all one when ``shared_machine`` is set.
        """
        return "" if self.shared_machine else node.node_id

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        """What a node removes besides its runtime directory when the cluster goes down idle (``idle_down``):
        the cluster record, on the node that keeps it."""
        return []

    @abstractmethod
    def provision(self, name: str, spec: TaskSpec, holder: str | None = None) -> ClusterHandle:
        """Create the cluster, or reuse one of the same name with the same node count.

        ``holder`` (e.g. ``<dag_id>/<run_id>``) gets a lease on the cluster, created or reused, under the
        backend's lock; a holder that has one keeps it. ``None`` or ``""`` takes no lease. A cluster being
        torn down is waited for (``busy_wait``), then made afresh; one with nodes left unclean by a
        teardown is refused until that teardown is finished.
        """

    @abstractmethod
    def find(self, name: str) -> ClusterHandle | None:
        """The cluster of that name, if this backend has it."""

    @abstractmethod
    def runner(self, node: Node) -> CommandRunner:
        """A command runner for one node of a cluster of this backend."""

    @abstractmethod
    def terminate(self, name: str, grace: float = 2.0, holder: str | None = None) -> Teardown:
        """Release ``holder``'s lease; kill every process the cluster started and release it when no lease
        remains. Idempotent: a cluster already gone is ``Teardown(removed=False)``.

        ``holder=None`` is a forced teardown: leases are ignored. A holder without a lease (``""``, a run
        whose provision failed) releases nothing and removes only a cluster nobody holds. When other
        leases remain nothing is killed and their holders are returned in ``kept_for``. Nodes that do not
        answer within the connect timeout are returned in ``unclean`` and kept in the record.
        """

    def _wait_out_teardown(self, attempt: Callable[[], _T], pause: float) -> _T:
        """Run ``attempt`` until no teardown of the same cluster name is in its way (``ClusterBusy``),
        for at most ``busy_wait`` seconds."""
        deadline = time.monotonic() + self.busy_wait
        while True:
            try:
                return attempt()
            except ClusterBusy as busy:
                if time.monotonic() > deadline:
                    raise ClusterBusy(
                        f"{busy}; waited {self.busy_wait:g}s for it. If that teardown was interrupted, "
                        "tear the cluster down again, then retry"
                    ) from None
            time.sleep(pause)

    def sync_files(self, handle: ClusterHandle, spec: TaskSpec) -> None:
        """Copy ``workdir`` and local ``file_mounts`` to every node before setup, through each node's
        runner (a local copy, SFTP, a tar stream over exec), ``SYNC_PARALLEL`` nodes at a time. A failure
        names the field that asked for the copy."""
        if not spec.workdir and not spec.file_mounts:
            return
        for field_name, src in [("workdir", spec.workdir or "")] + [
            (f"file_mounts.{d}", s) for d, s in spec.file_mounts.items()
        ]:
            if src and not Path(src).exists():
                raise SpecError(field_name, f"{src} does not exist; fix the path")

        def one(node: Node) -> None:
            runner = self.runner(node)
            copies = [("workdir", spec.workdir, f"{node.home}/sky_workdir")] if spec.workdir else []
            for dest, src in spec.file_mounts.items():
                copies.append(
                    (f"file_mounts.{dest}", src, f"{node.home}/{dest[2:]}" if dest.startswith("~/") else dest)
                )
            for field_name, src, target in copies:
                try:
                    if Path(src).is_dir():
                        runner.put_tree(src, target)
                    else:
                        runner.put_file(src, target)
                except RunnerError as exc:
                    raise SpecError(field_name, f"copying to {node.ip} failed: {exc}") from None

        with ThreadPoolExecutor(min(SYNC_PARALLEL, len(handle.nodes))) as pool:
            list(pool.map(one, handle.nodes))

    def workdir(self, node: Node, spec: TaskSpec) -> str:
        """Where setup and run execute on a node: ``~/sky_workdir`` when a workdir is synced."""
        return f"{node.home}/sky_workdir" if spec.workdir else node.home

    def close(self) -> None:  # noqa: B027 - optional
        """Drop connections held by runners."""


# -- cluster records: leases, teardown in progress, nodes left unclean ------------------------------------


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def new_record(handle: ClusterHandle, holder: str | None) -> dict[str, Any]:
    """The record of a cluster just made: its handle and the first holder's lease."""
    return add_lease({**handle.to_dict(), "leases": {}}, holder)


def add_lease(record: Mapping[str, Any], holder: str | None) -> dict[str, Any]:
    """``record`` with a lease for ``holder``; a holder that has one keeps it (and its ``since``)."""
    out = copy.deepcopy(dict(record))
    leases = out.setdefault("leases", {})
    if holder and holder not in leases:
        leases[holder] = {"holder": holder, "since": _now()}
    return out


def check_reusable(record: Mapping[str, Any], name: str, num_nodes: int) -> None:
    """Raise unless a provision may join the cluster: being torn down, half torn down, or another size."""
    down = record.get("down")
    if down:
        by = f" by {down['holder']}" if down.get("holder") else ""
        raise ClusterBusy(f"cluster {name!r} is being torn down (since {down.get('since')}{by})")
    unclean = record.get("unclean") or {}
    if unclean:
        raise BackendError(
            f"cluster {name!r} has a teardown to finish: {'; '.join(unclean.values())}. Processes of the "
            "cluster may still run there. Tear it down again once they answer (it cleans only those "
            "nodes), or use another cluster name"
        )
    count = len(record["nodes"])
    if count != num_nodes:
        raise BackendError(
            f"cluster {name!r} exists with {count} nodes but the task asks for "
            f"{num_nodes}: tear it down first or use another cluster name"
        )


def begin_teardown(record: Mapping[str, Any], holder: str | None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Release ``holder``'s lease. Returns the new record and the holders that keep the cluster; when none
    do (or ``holder`` is None: forced), the record is marked ``down`` and every lease dropped."""
    out = copy.deepcopy(dict(record))
    leases: dict[str, Any] = out.get("leases") or {}
    if holder is not None:
        leases.pop(holder, None)
        if leases:
            out["leases"] = leases
            return out, tuple(leases)  # in the order they were taken
    out["leases"] = {}
    out["down"] = {"since": _now(), "holder": holder or ""}
    return out, ()


def nodes_to_clean(record: Mapping[str, Any]) -> list[Node]:
    """Every node, or only those an earlier teardown left unclean."""
    nodes = list(ClusterHandle.from_dict(record).nodes)
    unclean = record.get("unclean") or {}
    return [n for n in nodes if n.node_id in unclean] if unclean else nodes


def finish_teardown(record: Mapping[str, Any] | None, unclean: Mapping[str, str]) -> dict[str, Any] | None:
    """The record after a teardown: gone (None) when every node was cleaned, else naming the others."""
    if record is None or not unclean:
        return None
    out = copy.deepcopy(dict(record))
    out.pop("down", None)
    out["unclean"] = dict(unclean)
    return out


def unclean_reason(node: Node, error: BaseException | str) -> str:
    """``"<ip>: <why>"`` for a node a teardown could not clean."""
    text = str(error).strip() or type(error).__name__
    return text if text.startswith(f"{node.ip}:") else f"{node.ip}: {text}"


def teardown_result(unclean: Mapping[str, str], nodes: Sequence[Node]) -> Teardown:
    """The :class:`Teardown` after cleaning ``nodes``; ``unclean`` maps node id to why, in rank order."""
    return Teardown(
        removed=not unclean, unclean=tuple(unclean[n.node_id] for n in nodes if n.node_id in unclean)
    )
