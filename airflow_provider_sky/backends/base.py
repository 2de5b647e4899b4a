"""What every backend provides: provision, find and terminate N nodes, and a runner per node.

A backend never imports Airflow: it is configured from a plain dict (a connection's extras).

A cluster's record is its handle (``ClusterHandle.to_dict()``) plus who uses it and what is left to clean:

* ``leases``: ``{holder id: {"holder": ..., "since": ...}}``. Runs sharing a cluster (one ``cluster_name``)
  each hold a lease; a teardown releases its own and removes the cluster only when no other remains, so
  the short run's teardown never removes the cluster under the long run.
* ``down``: set while a teardown runs; a provision of that name waits for it to end, then starts afresh.
* ``unclean``: ``{node id: why}`` for nodes a teardown could not clean (they did not answer). The record
  stays, naming them, and the next teardown cleans only those.

The functions below change a record (a plain dict). The lifecycle that applies them is written once, in
:class:`Backend` (``provision``, ``terminate``, ``replace_nodes``): each backend supplies its
:class:`RecordStore` (a file under a lock, a file on the head changed by compare-and-swap) and the hooks that
make and delete its nodes.
"""

from __future__ import annotations

import copy
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from airflow_provider_sky.backends.gitworkdir import checkout
from airflow_provider_sky.backends.storage import (
    S3Access,
    StorageError,
    fetch_scripts,
    mount_args,
    mount_script,
    needs_storage,
    node_path,
    prepare_mount,
    presigned_copy,
    redact,
)
from airflow_provider_sky.errors import BackendError as BackendError
from airflow_provider_sky.errors import ClusterBusy as ClusterBusy
from airflow_provider_sky.model.gang import CUDA_VISIBLE_DEVICES
from airflow_provider_sky.node import runtime
from airflow_provider_sky.runners.base import CommandRunner, RunnerError
from airflow_provider_sky.spec import (
    Accelerator,
    BackendCapabilities,
    Resources,
    SpecError,
    TaskSpec,
    describe_resources,
    parse_task,
    problems_error,
    resource_problems,
    source_problems,
    spec_problems,
    unset_error,
)
from airflow_provider_sky.spec.nodes import existing_cluster, num_nodes_problem

_T = TypeVar("_T")
log = logging.getLogger(__name__)
#: nodes copied to at once by ``sync_files``
SYNC_PARALLEL = 16


#: ``Node.extra`` keys of a node whose GPUs the backend handed out: the canonical GPU name, the device
#: indices (what ``CUDA_VISIBLE_DEVICES`` lists) and what the machine has (for messages)
GPU_NAME = "gpu_name"
GPU_DEVICES = "gpu_devices"
MACHINE_GPUS = "machine_gpus"


@dataclass(frozen=True)
class Node:
    """One node of a cluster. ``root`` is the runtime directory on the node (job dirs live under it).

    ``extra`` is the backend's own; a backend that hands out GPUs sets ``gpu_name`` and ``gpu_devices``
    there (see :func:`node_devices`), and the env builder reads them.
    """

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


Change = Callable[[dict[str, Any] | None], tuple[dict[str, Any] | None, _T]]


class RecordStore(Protocol):
    """Where a backend keeps its cluster records, one per cluster name: a file under an ``fcntl`` lock
    (local), a file on the cluster's head changed by compare-and-swap (``headrecord``: SSH, Kubernetes,
    EC2). A record that names another cluster is refused, never acted on."""

    def load(self, name: str) -> dict[str, Any] | None:
        """The record of cluster ``name``, or None."""

    def update(self, name: str, change: Change[_T]) -> _T:
        """Apply ``change`` (record or None -> new record or None, result) atomically: under the store's
        lock, or again on the current record when it changed meanwhile. A new record of None deletes it;
        one equal to the current is not written. Returns the change's result."""


@dataclass
class Provisioning:
    """One call of :meth:`Backend.provision`: what the backend found or made for it.

    Only ``made`` (the backend's own: directories, host claims, pods, a launch) is ever undone when the
    call fails; nothing that was there before it is touched."""

    name: str
    spec: TaskSpec
    holder: str | None
    #: the nodes found or made before the record is written (a record kept on the head needs the head)
    handle: ClusterHandle | None = None
    #: what this call created, for :meth:`Backend.undo_provision`
    made: Any = None
    #: the record was made by this call (a new cluster), not joined
    fresh: bool = False


class Backend(ABC):
    """Provision / find / terminate; hand out runners. Implementations keep the rank order stable."""

    kind: str
    capabilities: BackendCapabilities
    #: the backend gives each node its own GPUs (``Node.extra``: ``gpu_devices``), so ranks get
    #: ``CUDA_VISIBLE_DEVICES`` from it; a backend whose runtime sets it (Kubernetes) leaves this False
    assigns_devices: bool = False
    #: seconds a provision waits for a teardown of the same cluster name to end before it gives up
    busy_wait: float = 120.0
    #: every node is on this one machine: one node-side keeper guards them all
    shared_machine: bool = False
    #: a process whose end ends a node (a pod's entrypoint): ended when the node goes down idle, so
    #: the node gives its resources back (0: none; the node's directories are removed either way)
    idle_down_kill: int = 0
    #: a command a node runs last when the cluster goes down idle, powering the machine off (EC2: the
    #: instance is launched to terminate on shutdown, so nothing keeps billing); '': none
    idle_down_poweroff: str = ""
    #: remote calls in flight at once for one gang (status, cancel, start); 0: every call at once. A
    #: backend whose calls all go through one server that does real work per call (Kubernetes' exec:
    #: a runc exec on the node each) sets it, so that a call's time limit counts from its start,
    #: not from the back of a queue on an overloaded server
    call_limit: int = 0

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

    def check_handle(self, handle: ClusterHandle) -> None:  # noqa: B027 - optional
        """Raise :class:`BackendError` when this process cannot act on ``handle``'s nodes at all (the
        local backend's nodes on another machine), before any call reports its ranks lost."""

    def spec_problems(self, spec: TaskSpec) -> list[tuple[str, str]]:
        """(field, why) for what of ``spec`` beyond its resources this backend refuses (the local backend:
        a file mount outside the nodes' homes); checked with everything else before any provision."""
        return []

    def fit(self, resources: Resources, num_nodes: int, name: str | None = None) -> list[tuple[str, str]]:
        """(field, why) for what stops ``num_nodes`` nodes with ``resources`` on this backend beyond its
        capabilities (GPUs a machine lacks, hosts too small); empty: they can be had. ``name``: the cluster,
        whose own nodes count as available when it exists. Default: nothing beyond the capabilities."""
        return []

    def lost_reason(self, node: Node) -> str | None:
        """Why a node that stopped answering is gone, when the backend can tell (an EC2 instance ended
        by a spot interruption); None when it cannot. Called once per lost rank, off the event loop."""
        return None

    def agent_endpoint(self, handle: ClusterHandle) -> tuple[str, int, bytes] | None:
        """Where the cluster's head agent listens and its token (``docs/node-agent.md``), when the
        cluster runs node agents; None: the per-node path only. Called off the event loop (it may ask
        the head node for the token once)."""
        return None

    def forget_agent(self, handle: ClusterHandle) -> None:  # noqa: B027 - optional
        """The head agent refused or did not answer: drop what :meth:`agent_endpoint` cached."""

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        """What a node removes besides its runtime directory when the cluster goes down idle (``idle_down``):
        the cluster record, on the node that keeps it."""
        return []

    @abstractmethod
    def find(self, name: str) -> ClusterHandle | None:
        """The cluster of that name, if this backend has it."""

    @abstractmethod
    def runner(self, node: Node) -> CommandRunner:
        """A command runner for one node of a cluster of this backend."""

    @abstractmethod
    def records(self, name: str, head: Node | None = None) -> RecordStore:
        """The store of cluster ``name``'s record; ``head``: its head node, where the record is kept on
        it and the caller knows it already (else the backend finds it)."""

    # -- the lifecycle, written once: provision, terminate, replace_nodes -----------------------------
    #
    # Every backend runs these sequences; it supplies its record store (``records``) and the hooks below
    # (making and deleting nodes, and what else is its own). The rules they keep: a provision joins a
    # cluster under the record's lock (check_reusable, a lease) or makes one and writes its record there;
    # a failed provision undoes only what it made; a teardown changes the record first and deletes
    # nothing when it cannot (another run's lease may be in it); leases are honoured.

    #: seconds between two tries of a provision that a teardown of the same name is in the way of
    busy_pause: float = 0.5
    #: the record store's errors that stop a teardown before anything is deleted (see ``teardown_refused``)
    record_errors: tuple[type[Exception], ...] = (BackendError,)

    def provision(self, name: str, spec: TaskSpec, holder: str | None = None) -> ClusterHandle:
        """Create the cluster, or reuse one of the same name with the same node count.

        ``holder`` (e.g. ``<dag_id>/<run_id>``) gets a lease on the cluster, created or reused, under the
        backend's lock; a holder that has one keeps it. ``None`` or ``""`` takes no lease. A cluster being
        torn down is waited for (``busy_wait``), then made afresh; one with nodes left unclean by a
        teardown is refused until that teardown is finished.
        """
        self.check_provision(name, spec)
        return self._wait_out_teardown(
            lambda: self._provision_once(Provisioning(name, spec, holder)), self.busy_pause
        )

    def _provision_once(self, p: Provisioning) -> ClusterHandle:
        """One try: the record store (the backend may find or make nodes first), then the record changed
        under its lock: joined (a lease) or made with the new nodes; on failure what this try made goes."""

        def change(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, ClusterHandle]:
            p.fresh = record is None
            if record is None:
                handle = self.create_nodes(p)
                return new_record(handle, p.holder), handle
            return self.join(p, record)

        try:
            handle = self.prepare_provision(p).update(p.name, change)
        except BaseException as exc:
            self.undo_provision(p, exc)
            raise
        return self.provisioned(p, handle)

    def check_provision(self, name: str, spec: TaskSpec) -> None:
        """What is checked once before any try: the name (never one of the backend's own paths)."""
        runtime.check_job_id(name)

    def prepare_provision(self, p: Provisioning) -> RecordStore:
        """The store the cluster's record is in. A backend that keeps it on the head finds or makes the
        nodes here (``p.handle``, and ``p.made`` for what it made)."""
        return self.records(p.name)

    def create_nodes(self, p: Provisioning) -> ClusterHandle:
        """The nodes of a new cluster, called under the record's lock when it has no record (``p.made``
        notes what is made, for ``undo_provision``). Default: those ``prepare_provision`` found or made."""
        if p.handle is None:
            raise BackendError(f"the {self.kind} backend made no nodes for cluster {p.name!r}")
        return p.handle

    def join(self, p: Provisioning, record: dict[str, Any]) -> tuple[dict[str, Any], ClusterHandle]:
        """The record joined by this provision (under its lock) and the handle it returns."""
        check_reusable(record, p.name, p.spec.num_nodes)
        return add_lease(record, p.holder), ClusterHandle.from_dict(record)

    def undo_provision(self, p: Provisioning, exc: BaseException) -> None:  # noqa: B027 - optional
        """A try failed with ``exc``: remove what it made (``p.made``), nothing else; may raise a clearer
        error in place of ``exc``."""

    def provisioned(self, p: Provisioning, handle: ClusterHandle) -> ClusterHandle:
        """After the record is written: a new cluster's node agents, what a try made but did not use."""
        return handle

    def terminate(self, name: str, grace: float = 2.0, holder: str | None = None) -> Teardown:
        """Release ``holder``'s lease; kill every process the cluster started and release it when no lease
        remains. Idempotent: a cluster already gone is ``Teardown(removed=False)``.

        ``holder=None`` is a forced teardown: leases are ignored. A holder without a lease (``""``, a run
        whose provision failed) releases nothing and removes only a cluster nobody holds. When other
        leases remain nothing is killed and their holders are returned in ``kept_for``. Nodes that do not
        answer within the connect timeout are returned in ``unclean`` and kept in the record.
        """
        return self._teardown(name, grace, holder)

    def _teardown(self, name: str, grace: float, holder: str | None, idle_only: bool = False) -> Teardown:
        """``terminate``: the record changed first (the lease released, or the teardown marked), then the
        nodes deleted. With ``idle_only`` only a cluster nobody holds (no record) goes."""
        scope = self.teardown_scope(name)
        if scope is None:
            return Teardown(removed=False)
        read: list[dict[str, Any] | None] = []

        def begin(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
            read[:] = [record]
            if record is None:
                return self.begin_unrecorded(name, holder)
            self.check_teardown(name, record)
            if idle_only:  # adopted again, or being torn down: not idle
                return record, (record, tuple(record.get("leases") or {}) or ("its record",))
            new, kept_for = begin_teardown(record, holder)
            return new, (new, kept_for)

        try:
            store = self.teardown_records(name, scope)
            if store is None and idle_only:
                return Teardown(removed=False)
            begun = store.update(name, begin) if store is not None else (None, ())
        except self.record_errors as exc:
            refused = self.teardown_refused(
                name, holder, bool(read), idle_only, read[0] if read else None, exc
            )
            if refused is not None:
                raise refused from None
            begun = (None, ())
        if begun is None:
            return Teardown(removed=False)
        record, kept_for = begun
        if kept_for:
            log.info("cluster %s kept: still held by %s", name, ", ".join(kept_for))
            return Teardown(removed=False, kept_for=kept_for)
        return self.delete_cluster(name, scope, record, grace)

    def teardown_scope(self, name: str) -> Any:
        """What of cluster ``name`` is there to tear down (the backend's own: pods, instances); None:
        nothing. Default: the record decides."""
        return name

    def teardown_records(self, name: str, scope: Any) -> RecordStore | None:
        """The store whose record the teardown changes first; None: there is no record to honour."""
        return self.records(name)

    def begin_unrecorded(self, name: str, holder: str | None) -> tuple[dict[str, Any] | None, Any]:
        """The teardown's change when there is no record: (new record, (record, kept_for)); a result of
        None means there is no such cluster. Default: none."""
        return None, None

    def check_teardown(self, name: str, record: Mapping[str, Any]) -> None:  # noqa: B027 - optional
        """Raise when this process must not tear down the cluster ``record`` names (nothing changed yet)."""

    def teardown_refused(
        self,
        name: str,
        holder: str | None,
        read: bool,
        idle_only: bool,
        record: Mapping[str, Any] | None,
        exc: Exception,
    ) -> BackendError | None:
        """The error when the record could not be changed (``read``: it was read); nothing is deleted
        then. None: delete anyway (a forced teardown, where the backend knows its nodes without it)."""
        return BackendError(
            f"cluster {name!r}: the teardown could not update its record ({exc}), so nothing was deleted: "
            "another run may still hold the cluster. Tear it down again once the record can be written"
        )

    def delete_cluster(self, name: str, scope: Any, record: dict[str, Any] | None, grace: float) -> Teardown:
        """No lease remains: delete the nodes. Default: the nodes the record names (only those an
        earlier teardown left unclean, when it did), then the record is removed, or names the nodes that
        could not be cleaned."""
        assert record is not None
        nodes = nodes_to_clean(record)
        unclean = self.delete_nodes(name, nodes, grace)

        def finish(current: dict[str, Any] | None) -> tuple[dict[str, Any] | None, None]:
            left = finish_teardown(current, unclean)
            if left is None:
                self.removed(name, record)
            return left, None

        self.records(name).update(name, finish)
        return teardown_result(unclean, nodes)

    def delete_nodes(self, name: str, nodes: list[Node], grace: float) -> dict[str, str]:
        """Kill the cluster's processes on ``nodes`` and remove them; node id -> why, for those that could
        not be cleaned (:func:`unclean_reason`)."""
        raise NotImplementedError(f"the {self.kind} backend deletes its nodes in delete_cluster")

    def removed(self, name: str, record: Mapping[str, Any]) -> None:  # noqa: B027 - optional
        """The record is going (under its lock): what else of the cluster goes with it."""

    def replace_nodes(self, handle: ClusterHandle, ranks: Sequence[int]) -> ClusterHandle:
        """Put a new node in place of each lost node of ``ranks`` (the healthy ones are kept) and record
        it, so a teardown covers the new nodes; returns the cluster's handle, rank order unchanged.

        Called between two attempts of a gang with retries, off the event loop, with the handle the
        caller saw. A rank whose recorded node is no longer the one in ``handle`` was replaced already
        (by another watcher): it is left as recorded. New nodes need no setup here: the caller runs it.
        Default: this backend cannot; a :class:`BackendError` says why, and the retry fails naming it.
        """
        raise BackendError(f"the {self.kind} backend cannot replace a lost node")

    def _replace_in_record(self, handle: ClusterHandle, ranks: Sequence[int], where: str) -> ClusterHandle:
        """``replace_nodes`` for a backend whose new nodes are picked under the record's lock (a node
        number, a spare host): ``pick_replacements`` chooses them, the record names them, then
        ``replaced`` does what follows (the old nodes cleaned, agents started)."""
        name = handle.name

        def change(
            record: dict[str, Any] | None,
        ) -> tuple[dict[str, Any] | None, tuple[ClusterHandle, list[Node]]]:
            if record is None:
                raise BackendError(f"cluster {name!r} has no record {where}: it was torn down")
            if record.get("down"):
                raise BackendError(f"cluster {name!r} is being torn down")
            todo = [r for r in ranks if still_recorded(record, r, handle.nodes[r])]
            for rank, node in self.pick_replacements(name, record, handle, todo).items():
                record = record_replacement(record, rank, node)
            return record, (ClusterHandle.from_dict(record), [handle.nodes[r] for r in todo])

        new, lost = self.records(name, handle.nodes[0]).update(name, change)
        return self.replaced(handle, new, ranks, lost)

    def _replace_made(self, handle: ClusterHandle, ranks: Sequence[int]) -> ClusterHandle:
        """``replace_nodes`` for a backend whose new nodes take long to make (pods, instances): made
        outside the record's lock by ``make_replacements``, then recorded; a rank another watcher replaced
        meanwhile keeps its node and ours is deleted; a failure deletes only what this call made."""
        name = handle.name
        store = self.records(name, handle.nodes[0])
        record = store.load(name)
        if record is None:
            raise BackendError(f"cluster {name!r} has no record on its head: it was torn down")
        todo = [r for r in ranks if still_recorded(record, r, handle.nodes[r])]
        if not todo:
            return ClusterHandle.from_dict(record)
        made: list[Any] = []
        try:
            new = self.make_replacements(handle, record, ranks, todo, made)
            spare = store.update(name, replacements_recorder(name, handle, new))
        except BaseException as exc:
            self.undo_replacements(handle, todo, made, exc)
            raise
        if spare:
            self.delete_spare(spare)
        found = store.load(name)
        assert found is not None
        return ClusterHandle.from_dict(found)

    def pick_replacements(
        self, name: str, record: dict[str, Any], handle: ClusterHandle, todo: list[int]
    ) -> dict[int, Node]:
        """Rank -> its new node, chosen under the record's lock (``_replace_in_record``)."""
        raise BackendError(f"the {self.kind} backend cannot replace a lost node")

    def replaced(
        self, old: ClusterHandle, new: ClusterHandle, ranks: Sequence[int], lost: list[Node]
    ) -> ClusterHandle:
        """After the record names the new nodes (``_replace_in_record``): the lost nodes' leftovers."""
        return new

    def make_replacements(
        self,
        handle: ClusterHandle,
        record: dict[str, Any],
        ranks: Sequence[int],
        todo: list[int],
        made: list[Any],
    ) -> dict[int, Node]:
        """Rank -> a new node for each of ``todo`` (``_replace_made``), the lost ones deleted; ``made``
        notes what is made as it is made."""
        raise BackendError(f"the {self.kind} backend cannot replace a lost node")

    def undo_replacements(  # noqa: B027 - optional
        self, handle: ClusterHandle, todo: list[int], made: list[Any], exc: BaseException
    ) -> None:
        """A replacement failed with ``exc``: delete what it made (``made``); may raise a clearer error."""

    def delete_spare(self, node_ids: list[str]) -> None:  # noqa: B027 - optional
        """Delete new nodes another watcher's replacement made unneeded."""

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

    def sync_files(self, handle: ClusterHandle, spec: TaskSpec, storage: S3Access | None = None) -> None:
        """Copy ``workdir`` and ``file_mounts`` to every node before setup, through each node's runner (a
        local copy, SFTP, a tar stream over exec), ``SYNC_PARALLEL`` nodes at a time; ``s3://`` sources
        are fetched by each node from presigned URLs, and bucket mounts (``spec.storage``) mounted with
        rclone (``airflow_provider_sky.backends.storage``), both with ``storage``'s S3 access. A failure names
        the field that asked for the copy."""
        if not spec.workdir and not spec.file_mounts and not spec.storage:
            return
        if problems := source_problems(spec):  # checked before provisioning too; a source may go since
            raise problems_error(self.kind, problems)
        if storage is None and needs_storage(spec.file_mounts, spec.storage):
            field_name = (
                [f"file_mounts.{d}" for d, s in spec.file_mounts.items() if s.startswith("s3://")]
                + [f"file_mounts.{d}" for d in spec.storage]
            )[0]
            raise SpecError(
                field_name,
                "an S3 bucket needs AWS credentials on the launching side: give the operator an aws "
                "connection (storage_aws_conn_id, default aws_default) or set the usual AWS_* variables",
            )
        # listed and signed once for every node: (field, key, path relative to the node's home or "/")
        fetches: list[tuple[str, str, str, str]] = []
        for dest, src in spec.file_mounts.items():
            if src.startswith("s3://"):
                assert storage is not None
                try:
                    for key, path, url in presigned_copy(storage, src, dest):
                        fetches.append((f"file_mounts.{dest}", key, path, url))
                except StorageError as exc:
                    raise SpecError(f"file_mounts.{dest}", exc.message) from None
        for dest, mount in spec.storage.items():
            assert storage is not None
            try:
                if prepare_mount(storage, mount) and not mount.persistent:
                    log.warning(
                        "file_mounts.%s: bucket %s was created for this task and is kept after teardown "
                        "(persistent: false is not honoured yet); delete it when done",
                        dest,
                        mount.bucket,
                    )
            except StorageError as exc:
                raise SpecError(f"file_mounts.{dest}", exc.message) from None

        def one(node: Node) -> None:
            runner = self.runner(node)
            copies = []
            if spec.workdir_git is not None:  # SkyPilot's workdir: {url, ref}
                checkout(runner, node.ip, node.home, spec.workdir_git)
            elif spec.workdir:
                copies.append(("workdir", spec.workdir, f"{node.home}/sky_workdir"))
            for dest, src in spec.file_mounts.items():
                if not src.startswith("s3://"):
                    copies.append((f"file_mounts.{dest}", src, node_path(node.home, dest)))
            for field_name, src, target in copies:
                try:
                    local = str(Path(src).expanduser())
                    if Path(local).is_dir():
                        runner.put_tree(local, target)
                    else:
                        runner.put_file(local, target)
                except RunnerError as exc:
                    raise SpecError(field_name, f"copying to {node.ip} failed: {exc}") from None
            by_field: dict[str, list[tuple[str, str, str]]] = {}
            for field_name, key, path, url in fetches:
                by_field.setdefault(field_name, []).append((key, node_path(node.home, path), url))
            for field_name, items in by_field.items():
                for script in fetch_scripts(items):
                    try:
                        res = runner.run_script(script, timeout=3600)
                    except RunnerError as exc:
                        raise SpecError(
                            field_name, f"fetching the bucket on {node.ip} failed: {exc}"
                        ) from None
                    if res.returncode != 0:
                        raise SpecError(
                            field_name,
                            f"fetching the bucket on {node.ip} failed: {res.error_text or res.returncode}",
                        )
            for dest, mount in spec.storage.items():
                assert storage is not None
                field_name = f"file_mounts.{dest}"
                args = mount_args(mount, node_path(node.home, dest), node.root)
                try:
                    res = runner.run_script(mount_script(storage, mount), args, timeout=120)
                except RunnerError as exc:
                    raise SpecError(field_name, f"mounting {mount.url} on {node.ip} failed: {exc}") from None
                if res.returncode == 3:
                    raise SpecError(
                        field_name,
                        f"{mount.mode} of {mount.url} needs rclone and FUSE on the node, and {node.ip} "
                        f"has not: {res.error_text.strip()}. Install them on the nodes (Debian/Ubuntu: "
                        "apt-get install rclone fuse3; in the image for image_id), or use mode: COPY",
                    )
                if res.returncode != 0:
                    why = redact(res.error_text or f"exit code {res.returncode}", storage)
                    raise SpecError(field_name, f"mounting {mount.url} on {node.ip} failed: {why}")

        with ThreadPoolExecutor(min(SYNC_PARALLEL, len(handle.nodes))) as pool:
            list(pool.map(one, handle.nodes))

    def workdir(self, node: Node, spec: TaskSpec) -> str:
        """Where setup and run execute on a node: ``~/sky_workdir`` when a workdir is synced."""
        return f"{node.home}/sky_workdir" if spec.workdir else node.home

    def close(self) -> None:  # noqa: B027 - optional
        """Drop connections held by runners."""


# -- resources: which alternative, which GPUs ----------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The resources a backend will provision: alternative ``index`` of ``total``, and why the earlier
    ones were passed over (``"#1 (H100:8): ..."``)."""

    resources: Resources
    index: int = 0
    total: int = 1
    passed_over: tuple[str, ...] = ()

    def note(self) -> str:
        """What the task log says: which alternative, and why not the ones before it."""
        text = describe_resources(self.resources)
        if self.total == 1:
            return f"resources: {text}"
        out = f"resources: alternative {self.index + 1} of {self.total} ({text})"
        if self.passed_over:
            out += "; passed over: " + "; ".join(self.passed_over)
        return out


def choose_resources(
    backend: Backend, spec: TaskSpec, name: str | None = None, backends: Mapping[str, str] | None = None
) -> Choice:
    """The first of the task's resources alternatives (one without ``any_of``/``ordered``) that the backend
    can honour and satisfy (:meth:`Backend.fit`); else one error naming what each alternative lacks.

    Shared by every backend: a backend is then handed ``spec.with_resources(choice.resources)`` and
    never sees the alternatives.
    """
    caps = backend.capabilities
    # what no alternative changes (node count, bucket mounts, the backend's own rules, missing sources):
    # gathered with the resources' problems, so one error names everything to fix, before any provision
    problems = spec_problems(spec, caps) + backend.spec_problems(spec) + source_problems(spec)
    if (unset := unset_error(spec)) is not None:  # a value the YAML left to launch time, never given
        problems.append((unset.field, unset.message))
    choices = spec.resource_choices
    passed: list[str] = []
    last: list[tuple[str, str]] = []
    chosen: Choice | None = None
    for index, res in enumerate(choices):
        found = resource_problems(res, caps, backends) or backend.fit(res, spec.num_nodes, name)
        if not found:
            chosen = Choice(res, index, len(choices), tuple(passed))
            break
        passed.append(f"#{index + 1} ({describe_resources(res)}): " + "; ".join(m for _, m in found))
        last = found
    if chosen is None and len(choices) == 1:
        problems += last
    elif chosen is None:
        problems.append(
            (
                "resources",
                f"none of the {len(choices)} alternatives can be had on the {caps.name} backend: "
                + " | ".join(passed),
            )
        )
    elif (
        chosen.resources.accelerators is not None
        and backend.assigns_devices
        and CUDA_VISIBLE_DEVICES in spec.envs
    ):
        problems.append(
            (
                f"envs.{CUDA_VISIBLE_DEVICES}",
                f"the {caps.name} backend gives each node its GPUs ({chosen.resources.accelerators}) in "
                f"{CUDA_VISIBLE_DEVICES}; remove it from envs",
            )
        )
    if problems or chosen is None:
        raise problems_error(caps.name, problems)
    return chosen


def recorded_resources(handle: ClusterHandle) -> Resources | None:
    """The resources a cluster was provisioned with, when its handle records them (``extra["resources"]``)."""
    raw = handle.extra.get("resources")
    if not isinstance(raw, Mapping):
        return None
    try:
        return parse_task({"run": "true", "resources": dict(raw)}).resources
    except SpecError:
        return None


def node_has(node: Node, acc: Accelerator | None) -> bool:
    """The node was given GPUs enough for ``acc`` (a node without GPU records fits anything: its backend
    does not hand GPUs out, e.g. Kubernetes, where the scheduler does)."""
    if GPU_NAME not in node.extra:
        return True
    if acc is None:
        return True
    name = str(node.extra.get(GPU_NAME) or "")
    return name.lower() == acc.name.lower() and len(node.extra.get(GPU_DEVICES) or ()) >= acc.gpus_per_node


def chosen_resources(spec: TaskSpec, handle: ClusterHandle) -> Resources:
    """Which of ``spec``'s alternatives the cluster runs: the one its handle records, else the first its
    nodes were given GPUs for; a spec without alternatives is its own choice."""
    if not spec.alternatives:
        return spec.resources
    recorded = recorded_resources(handle)
    if recorded is not None and recorded in spec.alternatives:
        return recorded
    for res in spec.alternatives:
        if all(node_has(n, res.accelerators) for n in handle.nodes):
            return res
    return spec.resources


def node_devices(node: Node, acc: Accelerator | None) -> list[int] | None:
    """The devices a rank on ``node`` sees (``CUDA_VISIBLE_DEVICES``): the first ``ceil(count)`` the node
    was given. None: no GPUs asked, or the backend hands none out."""
    devices = node.extra.get(GPU_DEVICES)
    if acc is None or devices is None:
        return None
    return [int(d) for d in devices][: acc.gpus_per_node]


def with_resources_recorded(handle: ClusterHandle, resources: Resources) -> ClusterHandle:
    """``handle`` naming the resources it was provisioned with (read back by :func:`chosen_resources`)."""
    recorded = TaskSpec(run="true", resources=resources).to_dict().get("resources", {})
    if handle.extra.get("resources") == recorded:
        return handle
    return replace(handle, extra={**handle.extra, "resources": recorded})


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
    if (problem := num_nodes_problem(num_nodes, existing_cluster(name, len(record["nodes"])))) is not None:
        raise BackendError(problem)


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


# -- lost nodes replaced between attempts ------------------------------------------------------------------


def still_recorded(record: Mapping[str, Any], rank: int, seen: Node) -> bool:
    """The record's node of ``rank`` is still the one a caller saw lost (not replaced by another)."""
    nodes = record.get("nodes") or []
    if not 0 <= rank < len(nodes):
        return False
    n = nodes[rank]
    return bool(n.get("node_id") == seen.node_id and n.get("ip") == seen.ip and n.get("root") == seen.root)


def record_replacement(record: Mapping[str, Any], rank: int, node: Node) -> dict[str, Any]:
    """``record`` with ``node`` in place of rank ``rank``'s node; ``extra["replaced"]`` keeps the history
    (a watcher that restarted with the old handle reads the record because of it)."""
    out = copy.deepcopy(dict(record))
    old = out["nodes"][rank]
    out["nodes"][rank] = asdict(node)
    extra = out.setdefault("extra", {})
    extra.setdefault("replaced", []).append(
        {
            "rank": rank,
            "old_ip": old.get("ip"),
            "old_node_id": old.get("node_id"),
            "ip": node.ip,
            "at": _now(),
        }
    )
    return out


def replacements_recorder(
    name: str, handle: ClusterHandle, new: Mapping[int, Node]
) -> Callable[[dict[str, Any] | None], tuple[dict[str, Any] | None, list[str]]]:
    """The head record's update that puts each of ``new`` (rank -> new node) in place of the node ``handle``
    saw lost; a rank another watcher replaced meanwhile keeps its node, and ours is returned as spare (its
    ``node_id``, for the caller to remove)."""

    def change(rec: dict[str, Any] | None) -> tuple[dict[str, Any] | None, list[str]]:
        if rec is None:
            raise BackendError(f"cluster {name!r} has no record on its head: it was torn down")
        spare = []
        for r, node in new.items():
            if still_recorded(rec, r, handle.nodes[r]):
                rec = record_replacement(rec, r, node)
            else:  # another watcher replaced it meanwhile: ours goes
                spare.append(node.node_id)
        return rec, spare

    return change
