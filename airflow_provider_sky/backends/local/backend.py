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
import functools
import json
import logging
import os
import shutil
import socket
from collections.abc import Mapping, Sequence
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
    Provisioning,
    add_lease,
    check_reusable,
    node_has,
    unclean_reason,
    with_resources_recorded,
)
from airflow_provider_sky.backends.local.records import FileRecords
from airflow_provider_sky.backends.local.topdir import mark_topdir
from airflow_provider_sky.backends.local.trash import discard
from airflow_provider_sky.backends.nodeagents import HostAgents, agents_on, parallel_map
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
        self.records_dir = self.base / RECORDS_DIR
        self._records = FileRecords(self.records_dir, self.base / ".lock")
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
            self.records_dir.mkdir(parents=True, exist_ok=True)
            probe = self.records_dir / f".test-{os.getpid()}"
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

    def records(self, name: str, head: Node | None = None) -> FileRecords:
        """Every cluster's record, in ``<state>/local/.clusters`` (``local/records.py``)."""
        return self._records

    def _gpus_in_use(self, exclude: str | None) -> dict[int, str]:
        """Device -> the cluster holding it, over every other cluster of this machine."""
        used: dict[int, str] = {}
        for path in self.records_dir.glob("*.json"):
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
        for path in self.records_dir.glob("*.json"):
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

    # -- the lifecycle's hooks (the sequence is Backend's) --------------------------------------------

    busy_pause = 0.2

    def check_provision(self, name: str, spec: TaskSpec) -> None:
        if problems := self.spec_problems(spec):  # checked before provisioning too (hook.check)
            raise problems_error(self.kind, problems)
        super().check_provision(name, spec)

    def prepare_provision(self, p: Provisioning) -> FileRecords:
        if disk := self._disk_problem(p.spec.resources.disk_size):
            raise BackendError(f"resources.disk_size: {disk}")
        return self._records

    def join(self, p: Provisioning, record: dict[str, Any]) -> tuple[dict[str, Any], ClusterHandle]:
        """A cluster of this name: joined when its nodes were given the GPUs the task asks for."""
        check_reusable(record, p.name, p.spec.num_nodes)
        acc = p.spec.resources.accelerators
        have = ClusterHandle.from_dict(record)
        short = [n for n in have.nodes if not node_has(n, acc) or (acc and GPU_NAME not in n.extra)]
        if short:
            given = short[0].extra.get(GPU_NAME)
            held = f"{given}:{len(short[0].extra.get(GPU_DEVICES) or ())}" if given else "no GPUs"
            raise BackendError(
                f"cluster {p.name!r} exists with {held} per node but the task asks for {acc}: "
                "tear it down first or use another cluster name"
            )
        new = add_lease(record, p.holder)
        return new, ClusterHandle.from_dict(new)

    def create_nodes(self, p: Provisioning) -> ClusterHandle:
        """Under the records' lock: the cluster's GPUs, address block and node directories."""
        name, spec = p.name, p.spec
        acc = spec.resources.accelerators
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
        return with_resources_recorded(handle, spec.resources)

    def provisioned(self, p: Provisioning, handle: ClusterHandle) -> ClusterHandle:
        """A new cluster's node agents (one process per node) when the connection turns them on."""
        return self.agents.start_recorded(handle, self._records) if p.fresh and self.node_agent else handle

    # -- node agents ------------------------------------------------------------------------------

    def agent_endpoint(self, handle: ClusterHandle) -> tuple[str, int, bytes] | None:
        """The head agent's address (the handle's) and the token: cached in this process, else read
        from the head node's directory (one call)."""
        return self.agents.endpoint(handle)

    def forget_agent(self, handle: ClusterHandle) -> None:
        self.agents.forget(handle)

    def replace_nodes(self, handle: ClusterHandle, ranks: Sequence[int]) -> ClusterHandle:
        """A lost local node (its directory gone) gets a new one: the next free node number of the
        cluster, its own address and home, the lost node's GPUs. What still ran under the lost node's
        root is killed first (on a real machine it went with the machine)."""
        return self._replace_in_record(handle, ranks, "here")

    def pick_replacements(
        self, name: str, record: dict[str, Any], handle: ClusterHandle, todo: list[int]
    ) -> dict[int, Node]:
        ids = [n["node_id"] for n in record["nodes"]]
        ids += [r.get("old_node_id") or "" for r in (record.get("extra") or {}).get("replaced", [])]
        nxt = 1 + max((int(i.rsplit("-", 1)[1]) for i in ids if i.rsplit("-", 1)[-1].isdigit()), default=-1)
        cluster_dir = Path(record["extra"].get("dir", self.base / name))
        block = int(record["extra"]["block"])
        new: dict[int, Node] = {}
        for rank in todo:
            if nxt >= LOCAL_MAX_NODES:
                raise BackendError(f"cluster {name!r} has used all {LOCAL_MAX_NODES} node numbers")
            home = cluster_dir / f"node-{nxt}"
            home.mkdir(parents=True, exist_ok=True)
            seen = handle.nodes[rank]
            new[rank] = Node(
                node_ip(block, nxt), f"node-{nxt}", str(home / ".sky"), str(home), dict(seen.extra)
            )
            nxt += 1
        return new

    def replaced(
        self, old: ClusterHandle, new: ClusterHandle, ranks: Sequence[int], lost: list[Node]
    ) -> ClusterHandle:
        if lost:  # the lost nodes' directories are gone: clean from the cluster's
            cluster_dir = str(new.extra.get("dir", self.base / new.name))
            left = self._clean([replace(n, home=cluster_dir) for n in lost], 0.5)
            if left:
                log.warning(
                    "cluster %s: a replaced node could not be cleaned: %s", new.name, "; ".join(left.values())
                )
        return new

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        """The cluster's directory and record (the keeper of this machine removes them)."""
        return [str(handle.extra.get("dir", self.base / handle.name)), str(self._records.path(handle.name))]

    def find(self, name: str) -> ClusterHandle | None:
        record = self._records.load(name)
        return ClusterHandle.from_dict(record) if record is not None else None

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

    # -- teardown: the sequence is Backend's; the record is changed before anything is killed, and a
    # record that cannot be written deletes nothing (another run's lease may be in it)

    record_errors = (OSError,)

    def check_teardown(self, name: str, record: Mapping[str, Any]) -> None:
        for node in ClusterHandle.from_dict(record).nodes:  # before the record changes
            check_machine(node, f"tear down cluster {name!r}")

    def teardown_refused(
        self,
        name: str,
        holder: str | None,
        read: bool,
        idle_only: bool,
        record: Mapping[str, Any] | None,
        exc: Exception,
    ) -> BackendError:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return BackendError(
            f"cluster {name!r}: the teardown could not update the record {self._records.path(name)} "
            f"({why}), so nothing was deleted: the cluster is kept as it was. "
            "Tear it down again once the state directory is writable"
        )

    def delete_nodes(self, name: str, nodes: list[Node], grace: float) -> dict[str, str]:
        """Every node is on this machine: one call for all of them (one scan of /proc, not one per
        node); their files go with the cluster's tree (``removed``)."""
        unclean: dict[str, str] = {}
        for start in range(0, len(nodes), TEARDOWN_CHUNK):
            unclean.update(self._clean(nodes[start : start + TEARDOWN_CHUNK], grace, remove=False))
        return unclean

    def removed(self, name: str, record: Mapping[str, Any]) -> None:
        discard(Path(record["extra"].get("dir", self.base / name)), self.base)


def _loopback(node: Node) -> str:
    return "127.0.0.1"


def _reported(output: str, word: str) -> set[str]:
    """The roots a teardown call reported with ``word`` (``REMOVED`` / ``ABSENT``)."""
    return {line[len(word) + 1 :] for line in output.splitlines() if line.startswith(word + " ")}
