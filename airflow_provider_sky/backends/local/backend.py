"""The embedded default: N "nodes" on this machine, each with its own loopback IP and home.

Node i of a cluster gets ``127.<block>.<i // 254>.<i % 254 + 1>`` (Linux routes all of 127/8 to ``lo``,
so a rank can bind its own address; 254 clusters of up to 4,096 nodes, clear of the ``127.0.x.x`` the
SSH test hosts use) and the directory ``<state>/local/<cluster>/node-<i>`` as its home. Cluster
records (with the rank order and the leases, see ``backends.base``) live in
``<state>/local/.clusters/<name>.json`` and change only under an ``fcntl`` lock (``<state>/local/.lock``).
Every path of the backend's own under ``<state>/local`` starts with a dot (``.clusters``, ``.lock``,
``.trash``) and no cluster name can (``runtime.check_job_id``), so a cluster's tree never is one of them.

GPUs: the machine's (``nvidia-smi`` / ``rocm-smi``, or the connection's ``accelerators`` extra) are split
among the nodes of a cluster that asks for them, each node its own devices (``CUDA_VISIBLE_DEVICES``), and
devices held by another cluster of this machine are not handed out again until it is torn down.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import logging
import os
import shutil
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from airflow_provider_sky.backends.base import (
    GPU_DEVICES,
    GPU_NAME,
    MACHINE_GPUS,
    Backend,
    BackendError,
    ClusterHandle,
    Node,
    Teardown,
    add_lease,
    begin_teardown,
    check_reusable,
    finish_teardown,
    new_record,
    node_has,
    nodes_to_clean,
    record_replacement,
    still_recorded,
    teardown_result,
    unclean_reason,
    with_resources_recorded,
)
from airflow_provider_sky.backends.local.topdir import mark_topdir
from airflow_provider_sky.backends.local.trash import discard
from airflow_provider_sky.backends.nodeagents import EXTRA_KEY, HostAgents, agents_on, parallel_map
from airflow_provider_sky.model.gang import rank_order
from airflow_provider_sky.node import runtime
from airflow_provider_sky.node.accelerators import Inventory, detect_local, indices_text, pack, parse_declared
from airflow_provider_sky.runners.local import LocalRunner
from airflow_provider_sky.spec import (
    Accelerator,
    BackendCapabilities,
    Resources,
    SpecError,
    TaskSpec,
    problems_error,
)

log = logging.getLogger(__name__)

LOCAL_MAX_NODES = 4096
#: the records' directory under ``<state>/local`` (``clusters`` was a cluster name too: its teardown
#: took every other cluster's record with it)
RECORDS_DIR = ".clusters"
#: node roots per teardown call (argv stays far below Linux's limits)
TEARDOWN_CHUNK = 1024


def node_ip(block: int, i: int) -> str:
    """The loopback address of node ``i`` of the cluster holding address block ``block``."""
    return f"127.{block}.{i // 254}.{i % 254 + 1}"


#: ``Node.extra`` key: the machine a local node lives on (see :func:`this_machine`)
MACHINE = "machine"


@functools.cache
def this_machine() -> str:
    """This machine's name for local nodes: the host name, plus ``/etc/machine-id`` where there is one.

    Not the boot id: a record must stay usable (for its teardown) after a reboot of the same machine.
    """
    try:
        machine_id = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine_id = ""
    return f"{socket.gethostname()}/{machine_id[:12]}" if machine_id else socket.gethostname()


def check_machine(node: Node, action: str) -> None:
    """Refuse to act from another machine on a node of this one (a Celery worker elsewhere would see
    no process of the node and report its ranks lost, or tear down nothing and drop the record)."""
    home = node.extra.get(MACHINE)
    if home is not None and home != this_machine():
        raise BackendError(
            f"the local backend runs every node on the machine that provisioned the cluster ({home}); "
            f"this task runs on {this_machine()} and cannot {action} there. Run all of the gang's tasks "
            "on one machine (e.g. a Celery queue served by one worker: the operators' queue argument), "
            "or use a skyssh, skykubernetes or skyaws connection"
        )


def default_state_dir() -> Path:
    """``$SKY_PROVIDER_HOME``, else ``$AIRFLOW_HOME/sky``, else ``~/.airflow-provider-sky``."""
    if os.environ.get("SKY_PROVIDER_HOME"):
        return Path(os.environ["SKY_PROVIDER_HOME"])
    if os.environ.get("AIRFLOW_HOME"):
        return Path(os.environ["AIRFLOW_HOME"]) / "sky"
    return Path.home() / ".airflow-provider-sky"


class LocalBackend(Backend):
    """Processes on this machine stand in for nodes; nothing to install."""

    kind = "local"
    shared_machine = True
    assigns_devices = True
    capabilities = BackendCapabilities(
        name="local",
        max_nodes=LOCAL_MAX_NODES,
        supported_resources=frozenset(
            {"cpus", "memory", "labels", "cloud", "accelerators", "disk_size", "ports"}
        ),
        clouds=frozenset({"local"}),
    )

    def __init__(
        self,
        state_dir: str | os.PathLike[str] | None = None,
        accelerators: str | None = None,
        node_agent: bool = False,
    ) -> None:
        self.state_dir = Path(state_dir) if state_dir else default_state_dir()
        #: a node agent per local node (``backends/nodeagents.py``), the head's on 127.0.0.1. Off unless
        #: the connection turns it on: every local node is on this machine, where the rank wrappers
        #: already stop their siblings with nothing polling and a status is one call per poll; an
        #: agent would add a Python process per node and no guarantee
        self.node_agent = node_agent
        self.agents = HostAgents(
            self.kind, self.runner, parallel_map, listen="127.0.0.1", head_address=_loopback
        )
        self.base = self.state_dir / "local"
        #: dot-prefixed: no cluster name starts with a dot, so no cluster's tree can be the records
        self.records = self.base / RECORDS_DIR
        self._inventory: Inventory | None = None
        if accelerators is not None:
            try:
                self._inventory = parse_declared(accelerators, "accelerators")
            except ValueError as exc:
                raise BackendError(str(exc)) from None

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LocalBackend:
        return cls(config.get("state_dir"), config.get("accelerators"), agents_on(config, default=False))

    def inventory(self) -> Inventory:
        """This machine's GPUs: declared in the connection, else found with nvidia-smi / rocm-smi (once)."""
        if self._inventory is None:
            self._inventory = detect_local()
        return self._inventory

    def test_connection(self) -> str:
        """The state directory must be writable: nodes, logs and cluster records live there."""
        try:
            self.records.mkdir(parents=True, exist_ok=True)
            probe = self.records / f".test-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise BackendError(
                f"state_dir: {str(self.state_dir)!r} is not writable ({exc.strerror}); "
                "set the connection's state_dir to a directory this user can write"
            ) from None
        return (
            f"local backend: up to {LOCAL_MAX_NODES} nodes on this machine, GPUs: "
            f"{self.inventory().describe()}, state in {self.state_dir}"
        )

    def config(self) -> dict[str, Any]:
        return {"state_dir": str(self.state_dir)} | ({"node_agent": True} if self.node_agent else {})

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.records.mkdir(parents=True, exist_ok=True)
        with open(self.base / ".lock", "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _record(self, name: str) -> Path:
        runtime.check_job_id(name)
        return self.records / f"{name}.json"

    def _load(self, name: str) -> dict[str, Any] | None:
        """The raw record (handle, leases, unclean nodes); callers that change it hold the lock.

        A record that names another cluster is refused: nothing is ever done with its nodes under
        this name."""
        path = self._record(name)
        if not path.exists():
            return None
        data: dict[str, Any] = json.loads(path.read_text())
        if data.get("name") != name:
            raise BackendError(
                f"the record {path} names cluster {data.get('name')!r}, not {name!r}: nothing is done "
                "with it under this name. Move it back to the cluster it names, or remove it"
            )
        return data

    def _store(self, name: str, record: dict[str, Any]) -> None:
        tmp = self._record(name).with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(self._record(name))

    def _read(self, name: str) -> ClusterHandle | None:
        record = self._load(name)
        return ClusterHandle.from_dict(record) if record is not None else None

    def _gpus_in_use(self, exclude: str | None) -> dict[int, str]:
        """Device -> the cluster holding it, over every other cluster of this machine."""
        used: dict[int, str] = {}
        for path in self.records.glob("*.json"):
            if path.stem == exclude:
                continue
            with contextlib.suppress(ValueError, KeyError, OSError, TypeError):
                for node in json.loads(path.read_text())["nodes"]:
                    for device in (node.get("extra") or {}).get(GPU_DEVICES) or ():
                        used.setdefault(int(device), path.stem)
        return used

    def _allocate(self, acc: Accelerator, num_nodes: int, exclude: str | None) -> tuple[str, list[list[int]]]:
        """(canonical name, devices per node) for ``num_nodes`` x ``acc``, or SpecError saying what the
        machine has and who holds the rest."""
        inv = self.inventory()
        matching = inv.matching(acc.name)
        where = "resources.accelerators"
        if not matching:
            raise SpecError(
                where,
                f"the local backend: this machine has {inv.describe()}; the task asks for {acc} per node. "
                "Ask for a GPU it has, or declare the machine's GPUs in the skylocal connection's extra "
                '"accelerators" (e.g. "H100:8")',
            )
        used = self._gpus_in_use(exclude)
        free = [d.index for d in matching if d.index not in used]
        got = pack(free, acc.count, num_nodes)
        if got.problem:
            holders: dict[str, list[int]] = {}
            for d in matching:
                if d.index in used:
                    holders.setdefault(used[d.index], []).append(d.index)
            held = "; ".join(f"cluster {c!r} holds {indices_text(ds)}" for c, ds in holders.items())
            raise SpecError(
                where,
                f"the local backend: {num_nodes} node(s) x {acc} {got.problem} {matching[0].name} on this "
                f"machine ({inv.describe()})" + (f"; {held} (tear it down to free them)" if held else ""),
            )
        return matching[0].name, got.per_node

    def _disk_problem(self, disk_size: int | None) -> str:
        """The disk holding the nodes' homes must be at least ``disk_size`` GB (every node shares it)."""
        if not disk_size:
            return ""
        where = self.state_dir
        while not where.exists() and where != where.parent:
            where = where.parent
        total = shutil.disk_usage(where).total
        if disk_size * 1024**3 > total * 1.05:
            return (
                f"the local backend: the disk of {self.state_dir} has {total / 1024**3:.0f} GiB, the task "
                f"asks for {disk_size} GB"
            )
        return ""

    def fit(self, resources: Resources, num_nodes: int, name: str | None = None) -> list[tuple[str, str]]:
        """Enough free GPUs of the type asked on this machine, for every node, and disk enough."""
        problems = []
        if disk := self._disk_problem(resources.disk_size):
            problems.append(("resources.disk_size", disk))
        if resources.accelerators is not None:
            try:
                self._allocate(resources.accelerators, num_nodes, name)
            except SpecError as err:
                problems.append((err.field, err.message))
        return problems

    def _free_block(self) -> int:
        used = set()
        for path in self.records.glob("*.json"):
            with contextlib.suppress(ValueError, KeyError, OSError):
                used.add(int(json.loads(path.read_text())["extra"]["block"]))
        for block in range(1, 255):
            if block not in used:
                return block
        raise BackendError("local backend: all 254 address blocks (127.1-254.x.x) are in use; down a cluster")

    def spec_problems(self, spec: TaskSpec) -> list[tuple[str, str]]:
        """Every node of this machine shares one filesystem: a mount outside the node's home would be one
        path for all of them."""
        return [
            (
                f"file_mounts.{key}",
                "the local backend puts file mounts in each node's own home; use a '~/...' destination",
            )
            for key in (*spec.file_mounts, *spec.storage)
            if not key.startswith("~/")
        ]

    def provision(self, name: str, spec: TaskSpec, holder: str | None = None) -> ClusterHandle:
        if problems := self.spec_problems(spec):  # checked before provisioning too (hook.check)
            raise problems_error(self.kind, problems)

        made: list[bool] = []

        def attempt() -> ClusterHandle:
            with self._lock():
                made[:] = [self._load(name) is None]
                return self._provision_locked(name, spec, holder)

        handle = self._wait_out_teardown(attempt, 0.2)
        if made == [True] and self.node_agent:
            handle = self._start_agents(handle)
        return handle

    # -- node agents ------------------------------------------------------------------------------

    def _start_agents(self, handle: ClusterHandle) -> ClusterHandle:
        """A new cluster's node agents, one process per node; once every one joined the head, the
        record says where the head listens (``extra["agent"]``). Else the per-node path."""
        where = self.agents.start(handle.name, handle.nodes)
        if where is None:
            return handle
        with self._lock():
            record = self._load(handle.name)
            if record is None or record.get("down"):
                return handle  # torn down meanwhile: its teardown ended the agents
            record["extra"] = {**(record.get("extra") or {}), EXTRA_KEY: where}
            self._store(handle.name, record)
            return ClusterHandle.from_dict(record)

    def agent_endpoint(self, handle: ClusterHandle) -> tuple[str, int, bytes] | None:
        """The head agent's address (the handle's) and the token: cached in this process, else read
        from the head node's directory (one call)."""
        return self.agents.endpoint(handle)

    def forget_agent(self, handle: ClusterHandle) -> None:
        self.agents.forget(handle)

    def _provision_locked(self, name: str, spec: TaskSpec, holder: str | None) -> ClusterHandle:
        acc = spec.resources.accelerators
        if disk := self._disk_problem(spec.resources.disk_size):
            raise BackendError(f"resources.disk_size: {disk}")
        existing = self._load(name)
        if existing is not None:
            check_reusable(existing, name, spec.num_nodes)
            have = ClusterHandle.from_dict(existing)
            short = [n for n in have.nodes if not node_has(n, acc) or (acc and GPU_NAME not in n.extra)]
            if short:
                given = short[0].extra.get(GPU_NAME)
                held = f"{given}:{len(short[0].extra.get(GPU_DEVICES) or ())}" if given else "no GPUs"
                raise BackendError(
                    f"cluster {name!r} exists with {held} per node but the task asks for {acc}: "
                    "tear it down first or use another cluster name"
                )
            record = add_lease(existing, holder)
            if record != existing:
                self._store(name, record)
            return ClusterHandle.from_dict(record)
        gpus: tuple[str, list[list[int]]] | None = None
        if acc is not None:
            try:
                gpus = self._allocate(acc, spec.num_nodes, name)
            except SpecError as err:
                raise BackendError(f"{err.field}: {err.message}") from None
        block = self._free_block()
        mark_topdir(self.base)  # each cluster's tree in block groups of its own: see topdir
        cluster_dir = self.base / name
        ips = [node_ip(block, i) for i in range(spec.num_nodes)]
        nodes = []
        for i, ip in enumerate(rank_order(ips, head=ips[0])):
            home = cluster_dir / f"node-{i}"
            home.mkdir(parents=True, exist_ok=True)
            extra: dict[str, Any] = {MACHINE: this_machine()}
            if gpus is not None:
                extra |= {
                    GPU_NAME: gpus[0],
                    GPU_DEVICES: gpus[1][i],
                    MACHINE_GPUS: self.inventory().describe(),
                }
            nodes.append(
                Node(ip=ip, node_id=f"node-{i}", root=str(home / ".sky"), home=str(home), extra=extra)
            )
        handle = ClusterHandle(
            name=name,
            backend=self.kind,
            nodes=tuple(nodes),
            cloud="local",
            extra={"block": block, "dir": str(cluster_dir)},
        )
        handle = with_resources_recorded(handle, spec.resources)
        self._store(name, new_record(handle, holder))
        return handle

    def replace_nodes(self, handle: ClusterHandle, ranks: Sequence[int]) -> ClusterHandle:
        """A lost local node (its directory gone) gets a new one: the next free node number of the
        cluster, its own address and home, the lost node's GPUs. What still ran under the lost node's
        root is killed first (on a real machine it went with the machine)."""
        name = handle.name
        with self._lock():
            record = self._load(name)
            if record is None:
                raise BackendError(f"cluster {name!r} has no record here: it was torn down")
            if record.get("down"):
                raise BackendError(f"cluster {name!r} is being torn down")
            ids = [n["node_id"] for n in record["nodes"]]
            ids += [r.get("old_node_id") or "" for r in (record.get("extra") or {}).get("replaced", [])]
            nxt = 1 + max(
                (int(i.rsplit("-", 1)[1]) for i in ids if i.rsplit("-", 1)[-1].isdigit()), default=-1
            )
            cluster_dir = Path(record["extra"].get("dir", self.base / name))
            block = int(record["extra"]["block"])
            old: list[Node] = []
            for rank in ranks:
                seen = handle.nodes[rank]
                if not still_recorded(record, rank, seen):
                    continue  # replaced already (another watcher)
                if nxt >= LOCAL_MAX_NODES:
                    raise BackendError(f"cluster {name!r} has used all {LOCAL_MAX_NODES} node numbers")
                home = cluster_dir / f"node-{nxt}"
                home.mkdir(parents=True, exist_ok=True)
                node = Node(
                    node_ip(block, nxt), f"node-{nxt}", str(home / ".sky"), str(home), dict(seen.extra)
                )
                record = record_replacement(record, rank, node)
                old.append(seen)
                nxt += 1
            self._store(name, record)
        if old:  # the lost nodes' directories are gone: clean from the cluster's
            left = self._clean([replace(n, home=str(cluster_dir)) for n in old], 0.5)
            if left:
                log.warning(
                    "cluster %s: a replaced node could not be cleaned: %s", name, "; ".join(left.values())
                )
        return ClusterHandle.from_dict(record)

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        """The cluster's directory and record (the keeper of this machine removes them)."""
        return [str(handle.extra.get("dir", self.base / handle.name)), str(self._record(handle.name))]

    def find(self, name: str) -> ClusterHandle | None:
        return self._read(name)

    def check_handle(self, handle: ClusterHandle) -> None:
        check_machine(handle.nodes[0], f"reach cluster {handle.name!r}")

    def runner(self, node: Node) -> LocalRunner:
        check_machine(node, f"reach node {node.ip}")
        return LocalRunner(node.ip, node.home)

    def workdir(self, node: Node, spec: TaskSpec) -> str:
        return f"{node.home}/sky_workdir" if spec.workdir else node.home

    def _clean(self, nodes: list[Node], grace: float, remove: bool = True) -> dict[str, str]:
        """Tear ``nodes`` down in one call; the nodes it could not clean, with why. ``remove=False``:
        their processes only, the files stay (the whole cluster's tree is discarded afterwards)."""
        script = runtime.teardown_script(remove)
        args = [f"{grace:.3f}", *(n.root for n in nodes)]
        try:
            res = self.runner(nodes[0]).run_script(script, args, timeout=grace + 30 + 0.05 * len(nodes))
        except Exception as exc:  # kept in the record; the next teardown retries these nodes
            return {n.node_id: unclean_reason(n, exc) for n in nodes}
        done = _reported(res.text, "REMOVED") | _reported(res.text, "ABSENT")
        why = f"teardown failed: {res.error_text or f'exit code {res.returncode}'}"
        return {n.node_id: unclean_reason(n, why) for n in nodes if n.root not in done or res.returncode != 0}

    def terminate(self, name: str, grace: float = 2.0, holder: str | None = None) -> Teardown:
        """See :meth:`Backend.terminate`. The lease is released (or the teardown marked) in the record
        before anything is killed; a record that cannot be written deletes nothing (another run's lease
        may be in it) and the error says so: the cluster stays for the next teardown."""
        with self._lock():
            record = self._load(name)
            if record is None:
                return Teardown(removed=False)
            for node in ClusterHandle.from_dict(record).nodes:  # before the record changes
                check_machine(node, f"tear down cluster {name!r}")
            record, kept_for = begin_teardown(record, holder)
            try:
                self._store(name, record)
            except OSError as exc:
                raise BackendError(
                    f"cluster {name!r}: the teardown could not update the record {self._record(name)} "
                    f"({exc.strerror or exc}), so nothing was deleted: the cluster is kept as it was. "
                    "Tear it down again once the state directory is writable"
                ) from None
        if kept_for:
            log.info("cluster %s kept: still held by %s", name, ", ".join(kept_for))
            return Teardown(removed=False, kept_for=kept_for)
        nodes = nodes_to_clean(record)
        unclean: dict[str, str] = {}
        # every node is on this machine: one call for all of them (one scan of /proc, not one per node)
        for start in range(0, len(nodes), TEARDOWN_CHUNK):
            unclean.update(self._clean(nodes[start : start + TEARDOWN_CHUNK], grace, remove=False))
        with self._lock():
            left = finish_teardown(self._load(name), unclean)
            if left is None:
                discard(Path(record["extra"].get("dir", self.base / name)), self.base)
                self._record(name).unlink(missing_ok=True)
            else:
                self._store(name, left)
        return teardown_result(unclean, nodes)


def _loopback(node: Node) -> str:
    return "127.0.0.1"


def _reported(output: str, word: str) -> set[str]:
    """The roots a teardown call reported with ``word`` (``REMOVED`` / ``ABSENT``)."""
    return {line[len(word) + 1 :] for line in output.splitlines() if line.startswith(word + " ")}
