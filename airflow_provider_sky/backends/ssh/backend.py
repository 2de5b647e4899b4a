"""Gangs on existing machines over SSH: the hosts are given, "provisioning" checks and reserves them.

A cluster is a named set of hosts. Its record (rank order, resolved homes, leases) is kept on the head
node (``backends.headrecord``: ``~/.sky_airflow/.clusters/<cluster>.json``). Each node's runtime
directory is ``~/.sky_airflow/<cluster>``, claimed by the cluster when it is made (``claim``); teardown
kills everything under it and removes it.

Provisioning probes each host (home, CPUs, memory, GPUs with nvidia-smi / rocm-smi unless the connection
declares them) and takes, in rank order (head first, then by IP), the first hosts that have what the task
asks for; when too few do, the error names every host and what it has, and nothing runs.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
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
    recorded_resources,
    unclean_reason,
    with_resources_recorded,
)
from airflow_provider_sky.backends.headrecord import HeadRecords, record_path
from airflow_provider_sky.backends.nodeagents import HostAgents, endpoint
from airflow_provider_sky.backends.ssh.claim import CLAIM_SCRIPT, RELEASE_SCRIPT, TEARDOWN_GUARD, owner_of
from airflow_provider_sky.backends.ssh.config import SSHSettings, host_layout, parse_ssh_config
from airflow_provider_sky.model.gang import rank_order
from airflow_provider_sky.node import runtime
from airflow_provider_sky.node.accelerators import (
    DETECT_SCRIPT,
    Inventory,
    parse_detect_output,
)
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.runners.ssh import SSHNodeConfig, SSHRunner, wait_for_ssh
from airflow_provider_sky.spec import BackendCapabilities, Resources, TaskSpec
from airflow_provider_sky.spec.nodes import FIELD, connection_hosts, fitting_hosts, num_nodes_problem

log = logging.getLogger(__name__)

_HOME_SCRIPT = 'printf "%s\\n" "$HOME"; nproc 2>/dev/null || echo 0; ' + (
    "awk '/MemTotal/ {print $2}' /proc/meminfo 2>/dev/null || echo 0; "
    # the size of the disk holding the home (KiB), for disk_size
    "df -Pk \"$HOME\" 2>/dev/null | awk 'NR == 2 {print $2; found = 1} END {if (!found) print 0}'"
)


#: seconds a probe of a host is reused (the check before a provision and the provision itself)
PROBE_TTL = 30.0


@dataclass(frozen=True)
class HostProbe:
    """What provisioning learned of one host: where its home is, how big it is, its GPUs."""

    host: str
    port: int
    home: str
    cpus: int
    mem_kb: int
    gpus: Inventory = Inventory()
    disk_kb: int = 0

    def describe(self) -> str:
        mem = f", {self.mem_kb / 1024 / 1024:.0f} GiB" if self.mem_kb else ""
        disk = f", {self.disk_kb / 1024 / 1024:.0f} GiB disk" if self.disk_kb else ""
        return f"{self.gpus.describe()}, {self.cpus} CPUs{mem}{disk}"


class _NoFit(Exception):
    """Fewer hosts than asked have what the task asks for: (field, why) for the error."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _asked(res: Resources) -> str:
    parts = [str(res.accelerators)] if res.accelerators else []
    if res.cpus:
        parts.append(f"{res.cpus} CPUs")
    if res.memory:
        parts.append(f"{res.memory} GiB")
    if res.disk_size:
        parts.append(f"a {res.disk_size} GB disk")
    return ", ".join(parts) or "no particular resources"


_GPU_KEYS = (GPU_NAME, GPU_DEVICES, MACHINE_GPUS)


def _without_gpus(extra: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in extra.items() if k not in _GPU_KEYS}


def _gpus_of(node: Node | None) -> dict[str, Any]:
    return {k: v for k, v in (node.extra if node else {}).items() if k in _GPU_KEYS}


def _resolve_ip(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return str(socket.getaddrinfo(host, None)[0][4][0])


class SSHBackend(Backend):
    """Existing machines reached over SSH (paramiko), one rank per host."""

    kind = "ssh"
    assigns_devices = True
    #: how the head's cluster records are locked: ``auto`` (``flock`` if the head has it) or ``mkdir``
    record_lock = "auto"
    #: seconds a change of a record waits for the head's record lock before it fails, changing nothing
    record_lock_wait = 60.0

    def __init__(self, settings: SSHSettings | Sequence[str], **fields: Any) -> None:
        """From ``settings`` (what :meth:`from_config` reads from a connection); scripts and tests may
        pass the hosts and the other :class:`SSHSettings` fields as keywords instead."""
        if not isinstance(settings, SSHSettings):
            settings = SSHSettings(hosts=tuple(settings), **fields)
        elif fields:
            raise TypeError(f"SSHBackend(settings) takes no other arguments, got {sorted(fields)}")
        self.settings = settings
        layout = host_layout(settings)
        self.users: dict[tuple[str, int], str] = layout.users
        self.endpoints = layout.endpoints
        self.spares = layout.spares
        self.head = layout.head
        self.declared: dict[tuple[str, int], Inventory] = layout.declared
        self.user = settings.user
        self.host_key_policy = layout.policy
        self.max_parallel = max(1, int(settings.max_parallel))
        self.capabilities = BackendCapabilities(
            name="ssh",
            max_nodes=len(self.endpoints),
            supported_resources=frozenset(
                {"cpus", "memory", "labels", "cloud", "accelerators", "disk_size", "ports"}
            ),
            clouds=frozenset({"ssh"}),
        )
        self._runners: dict[tuple[str, int], SSHRunner] = {}
        self._probes: dict[tuple[str, int], tuple[float, HostProbe | Exception]] = {}
        self._probes_lock = threading.Lock()
        #: the hosts' node agents: the head listens on every address of its host (the others and the
        #: control plane reach it at its node's IP; nothing is accepted before the token is proven)
        self.agents = HostAgents(self.kind, self.runner, self._map, listen="0.0.0.0")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SSHBackend:
        """From a ``sky_ssh`` connection (see ``config.parse_ssh_config``)."""
        return cls(parse_ssh_config(config))

    def test_connection(self) -> str:
        """Every host greets, shows a host key that checks out and accepts the key; nothing is run."""

        def one(endpoint: tuple[str, int]) -> None:
            wait_for_ssh(*endpoint, self.settings.connect_timeout, max_delay=0.5)
            self._runner_for(*endpoint).connect()

        results = self._map(one, self.endpoints)
        errors = [
            f"{self.users[ep]}@{ep[0]}:{ep[1]}: {e}"
            for ep, e in zip(self.endpoints, results, strict=True)
            if isinstance(e, Exception)
        ]
        if errors:
            raise BackendError(f"{len(errors)} of {len(self.endpoints)} hosts failed: " + "; ".join(errors))
        return (
            f"{len(self.endpoints)} hosts reachable, host keys checked ({self.host_key_policy}), "
            f"key accepted; head {self.head[0]}:{self.head[1]}"
        )

    # -- connections ------------------------------------------------------------------------------

    def _pins_for(self, host: str, port: int) -> tuple[str, ...]:
        if isinstance(self.settings.pinned_host_keys, Mapping):
            v = (
                self.settings.pinned_host_keys.get(f"{host}:{port}")
                or self.settings.pinned_host_keys.get(host)
                or ()
            )
            return (v,) if isinstance(v, str) else tuple(v)
        return tuple(self.settings.pinned_host_keys)

    def _config(self, host: str, port: int) -> SSHNodeConfig:
        return SSHNodeConfig(
            host,
            user=self.users.get((host, port), self.user),
            port=port,
            private_key=self.settings.private_key,
            key_file=self.settings.key_file,
            passphrase=self.settings.passphrase,
            host_key_policy=self.host_key_policy,
            known_hosts=self.settings.known_hosts,
            pinned_host_keys=self._pins_for(host, port),
            connect_timeout=self.settings.connect_timeout,
        )

    def _runner_for(self, host: str, port: int) -> SSHRunner:
        if (host, port) not in self._runners:
            self._runners[(host, port)] = SSHRunner(self._config(host, port))
        return self._runners[(host, port)]

    def runner(self, node: Node) -> SSHRunner:
        return self._runner_for(node.extra["host"], int(node.extra["port"]))

    def close(self) -> None:
        for r in self._runners.values():
            r.close()
        self._runners.clear()

    def _map(self, fn: Any, items: Sequence[Any]) -> list[Any]:
        """Run ``fn`` over items in parallel (bounded); exceptions are returned, not raised."""

        def safe(item: Any) -> Any:
            try:
                return fn(item)
            except Exception as exc:  # reported per host by the caller
                return exc

        with ThreadPoolExecutor(min(self.max_parallel, max(1, len(items)))) as pool:
            return list(pool.map(safe, items))

    # -- records ----------------------------------------------------------------------------------

    def _head_runner(self) -> SSHRunner:
        return self._runner_for(*self.head)

    def records(self, name: str, head: Node | None = None) -> HeadRecords:
        """The cluster records, on the head host."""
        return HeadRecords(self._head_runner, self.head[0], self.record_lock, self.record_lock_wait)

    def _owner(self, name: str) -> str:
        """What the node directories of cluster ``name`` made through this head carry (``claim``)."""
        host, port = self.head
        return owner_of(f"{self.users[self.head]}@{_resolve_ip(host)}:{port}", name)

    def _claim(self, name: str, probes: Sequence[HostProbe]) -> list[HostProbe]:
        """Claim ``~/.sky_airflow/<name>`` on every host of a new cluster; the hosts newly claimed. A host
        where another cluster of that name holds it (its record on another head) is an error naming it,
        and the claims made here are given back: nothing is recorded, nothing is left."""
        owner = self._owner(name)

        def one(p: HostProbe) -> str:
            res = self._runner_for(p.host, p.port).run_script(CLAIM_SCRIPT, [name, owner], timeout=30)
            if res.returncode != 0 or not res.text.startswith(("CLAIMED", "OURS", "TAKEN")):
                raise BackendError(f"claiming ~/.sky_airflow/{name} failed: {res.error_text or res.text}")
            return res.text.strip()

        answers = self._map(one, probes)
        claimed = [p for p, a in zip(probes, answers, strict=True) if a == "CLAIMED"]
        problems = []
        for p, a in zip(probes, answers, strict=True):
            if isinstance(a, Exception):
                problems.append(f"{self._name((p.host, p.port))}: {a}")
            elif a.startswith("TAKEN"):
                other = a[len("TAKEN") :].strip().split(" ")[0] or "an unknown head"
                problems.append(
                    f"{self._name((p.host, p.port))} runs cluster {name!r} whose record is on {other}"
                )
        if problems:
            self._release(name, claimed)
            raise BackendError(
                f"cluster {name!r} cannot be made here: " + "; ".join(problems) + ". Its directory "
                f"~/.sky_airflow/{name} on that host belongs to that cluster (another connection lists the "
                "host with another head). Use another cluster name, or tear that cluster down through its "
                "own connection first"
            )
        return claimed

    def _release(self, name: str, probes: Sequence[HostProbe]) -> None:
        """Give back claims of ``_claim`` that no cluster uses (best effort: an empty directory is left)."""
        owner = self._owner(name)
        self._map(
            lambda p: self._runner_for(p.host, p.port).run_script(RELEASE_SCRIPT, [name, owner], timeout=30),
            probes,
        )

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        """The cluster record, kept on the head (rank 0's node unless the head lacked what the task asked
        for; then no node of the cluster holds it and it stays)."""
        node = handle.nodes[rank]
        if (node.extra.get("host"), int(node.extra.get("port", 0))) != self.head:
            return []
        return [f"{node.home}/{record_path(handle.name)}"]

    def find(self, name: str) -> ClusterHandle | None:
        record = self.records(name).load(name)
        return ClusterHandle.from_dict(record) if record is not None else None

    # -- lifecycle --------------------------------------------------------------------------------

    def _name(self, endpoint: tuple[str, int]) -> str:
        return f"{self.users[endpoint]}@{endpoint[0]}:{endpoint[1]}"

    def _probe(self, endpoint: tuple[str, int]) -> HostProbe:
        """Home, CPUs, memory and GPUs of a host (reused for ``PROBE_TTL`` seconds, failures too)."""
        with self._probes_lock:
            cached = self._probes.get(endpoint)
        if cached is not None and time.monotonic() - cached[0] < PROBE_TTL:
            if isinstance(cached[1], Exception):
                raise cached[1]
            return cached[1]
        try:
            probe: HostProbe | Exception = self._probe_now(endpoint)
        except Exception as exc:
            probe = exc
        with self._probes_lock:
            self._probes[endpoint] = (time.monotonic(), probe)
        if isinstance(probe, Exception):
            raise probe
        return probe

    def _probe_now(self, endpoint: tuple[str, int]) -> HostProbe:
        host, port = endpoint
        wait_for_ssh(host, port, self.settings.ready_timeout)
        declared = self.declared.get(endpoint)
        script = _HOME_SCRIPT if declared is not None else _HOME_SCRIPT + "\n" + DETECT_SCRIPT
        res = self._runner_for(host, port).run_script(script, timeout=self.settings.connect_timeout + 40)
        if res.returncode != 0:
            raise BackendError(f"{self._name(endpoint)}: probe failed: {res.error_text}")
        lines = res.text.split("\n")
        gpus = declared if declared is not None else parse_detect_output("\n".join(lines[4:]))
        numbers = [int(x) if x.strip().isdigit() else 0 for x in (lines + ["0"] * 4)[1:4]]
        return HostProbe(host, port, lines[0].strip(), numbers[0], numbers[1], gpus, numbers[2])

    # -- the lifecycle's hooks (the sequence is Backend's) --------------------------------------------

    def check_provision(self, name: str, spec: TaskSpec) -> None:
        """Enough hosts in the connection; every host is checked to answer and authenticate (probed)
        before anything runs, when the nodes are chosen."""
        super().check_provision(name, spec)
        if (problem := num_nodes_problem(spec.num_nodes, connection_hosts(len(self.endpoints)))) is not None:
            raise BackendError(f"{FIELD}: {problem}")

    def prepare_provision(self, p: Provisioning) -> HeadRecords:
        p.made = []  # the hosts whose directories this provision claimed
        return self.records(p.name)

    def _probe_all(self, endpoints: Sequence[tuple[str, int]]) -> list[HostProbe]:
        """Probes of ``endpoints``; any host not usable is an error naming each, before anything runs."""
        probes = self._map(self._probe, endpoints)
        errors = [
            f"{h}:{p}: {e}" for (h, p), e in zip(endpoints, probes, strict=True) if isinstance(e, Exception)
        ]
        if errors:
            raise BackendError("hosts not usable, nothing was started: " + "; ".join(errors))
        return probes

    @staticmethod
    def _misfit(res: Resources, p: HostProbe) -> tuple[str, str] | None:
        """(field, what the host lacks) when host ``p`` cannot run one node of ``res``; None when it can.
        ``cpus``/``memory`` on existing machines are checked, not ignored."""
        if res.cpus and p.cpus and float(res.cpus.rstrip("+")) > p.cpus:
            return "resources.cpus", f"has {p.cpus} CPUs, the task asks for {res.cpus}"
        if res.memory and p.mem_kb and float(res.memory.rstrip("+")) * 1024 * 1024 > p.mem_kb * 1.05:
            return (
                "resources.memory",
                f"has {p.mem_kb / 1024 / 1024:.1f} GiB, the task asks for {res.memory} GiB",
            )
        if res.disk_size and p.disk_kb and res.disk_size * 1024 * 1024 > p.disk_kb * 1.05:
            return (
                "resources.disk_size",
                f"has a {p.disk_kb / 1024 / 1024:.0f} GiB disk at its home, the task asks for {res.disk_size} GB",
            )
        acc = res.accelerators
        if acc is not None and len(p.gpus.matching(acc.name)) < acc.gpus_per_node:
            return "resources.accelerators", f"has {p.gpus.describe()}, the task asks for {acc}"
        return None

    def _rank_ordered(self) -> list[tuple[str, int]]:
        """Every host in rank order: the head first, then by IP (10.0.0.9 before 10.0.0.10)."""
        resolved = {(_resolve_ip(h), p): (h, p) for h, p in self.endpoints}
        head = (_resolve_ip(self.head[0]), self.head[1])
        return [resolved[k] for k in rank_order(list(resolved), head)]

    def _select(self, res: Resources, num_nodes: int) -> list[HostProbe]:
        """The first ``num_nodes`` hosts in rank order that have what ``res`` asks for, probed.

        The first ``num_nodes`` hosts must answer (as without GPUs); the others are probed only when some of
        those lack something. Too few: :class:`_NoFit` naming every host and what it has."""
        order = self._rank_ordered()
        first = self._probe_all(order[:num_nodes])
        if not any(self._misfit(res, p) for p in first):
            return first
        rest = self._map(self._probe, order[num_nodes:])
        probes: list[HostProbe | Exception] = [*first, *rest]
        fitting = [p for p in probes if isinstance(p, HostProbe) and not self._misfit(res, p)]
        fields: list[str] = []
        lines = []
        for ep, p in zip(order, probes, strict=True):
            if isinstance(p, Exception):
                lines.append(f"{self._name(ep)}: not usable ({p})")
                continue
            misfit = self._misfit(res, p)
            if misfit and misfit[0] not in fields:
                fields.append(misfit[0])
            lines.append(f"{self._name(ep)}: {misfit[1] if misfit else 'fits'} ({p.describe()})")
        bound = fitting_hosts(len(fitting), len(order), _asked(res), "; ".join(lines))
        if (problem := num_nodes_problem(num_nodes, bound)) is not None:
            raise _NoFit(", ".join(fields) or "resources", problem)
        return fitting[:num_nodes]

    def _existing_fits(self, name: str, record: Mapping[str, Any], res: Resources) -> list[HostProbe]:
        """The probes of an existing cluster's hosts, which must have what ``res`` asks for."""
        handle = ClusterHandle.from_dict(record)
        chosen = [(n.extra["host"], int(n.extra["port"])) for n in handle.nodes]
        probes = self._probe_all(chosen)
        short = [(p, m) for p in probes if (m := self._misfit(res, p))]
        if short:
            raise _NoFit(
                short[0][1][0],
                f"cluster {name!r} exists on hosts that lack what the task asks for ({_asked(res)}): "
                + "; ".join(f"{p.host}:{p.port} {m[1]}" for p, m in short)
                + ". Tear it down first or use another cluster name",
            )
        return probes

    def fit(self, resources: Resources, num_nodes: int, name: str | None = None) -> list[tuple[str, str]]:
        """Enough hosts with the GPUs, CPUs and memory asked (an existing cluster: its own hosts)."""
        if resources.accelerators is None and not (resources.cpus or resources.memory or resources.disk_size):
            return []  # nothing to compare: provisioning probes its hosts as it always did
        try:
            text = self.records(name).read(name) if name else None
            if text is not None:
                self._existing_fits(name or "", json.loads(text), resources)
            else:
                self._select(resources, num_nodes)
        except _NoFit as err:
            return [(err.field, err.message)]
        return []

    def _node(self, i: int, name: str, p: HostProbe, res: Resources) -> Node:
        extra: dict[str, Any] = {"host": p.host, "port": p.port, "user": self.users[(p.host, p.port)]}
        acc = res.accelerators
        if acc is not None:
            devices = p.gpus.matching(acc.name)[: acc.gpus_per_node]
            extra.update(
                {
                    GPU_NAME: devices[0].name,
                    GPU_DEVICES: [d.index for d in devices],
                    MACHINE_GPUS: p.gpus.describe(),
                }
            )
        return Node(
            ip=_resolve_ip(p.host),
            node_id=f"node-{i}",
            root=f"{p.home}/.sky_airflow/{name}",
            home=p.home,
            extra=extra,
        )

    def create_nodes(self, p: Provisioning) -> ClusterHandle:
        """The first hosts (rank order: head first, then by IP) that have what the task asks for; their
        directories are claimed first: a host where the name is another head's is refused."""
        res = p.spec.resources
        try:
            probes = self._select(res, p.spec.num_nodes)
        except _NoFit as err:
            raise BackendError(str(err)) from None
        p.made.extend(self._claim(p.name, probes))
        nodes = [self._node(i, p.name, probe, res) for i, probe in enumerate(probes)]
        return with_resources_recorded(
            ClusterHandle(name=p.name, backend=self.kind, nodes=tuple(nodes), cloud="ssh"), res
        )

    def join(self, p: Provisioning, record: dict[str, Any]) -> tuple[dict[str, Any], ClusterHandle]:
        """The cluster's hosts, in their stored order, must have what the task asks for; a node is a
        whole host: its GPUs for this task come from the probe, not from the record."""
        check_reusable(record, p.name, p.spec.num_nodes)
        res = p.spec.resources
        try:
            probes = self._existing_fits(p.name, record, res)
        except _NoFit as err:
            raise BackendError(str(err)) from None
        by_id = {n.node_id: n for n in (self._node(i, p.name, pr, res) for i, pr in enumerate(probes))}
        stored = ClusterHandle.from_dict(record)
        merged = tuple(
            Node(
                n.ip, n.node_id, n.root, n.home, {**_without_gpus(n.extra), **_gpus_of(by_id.get(n.node_id))}
            )
            for n in stored.nodes
        )
        return add_lease(record, p.holder), with_resources_recorded(replace(stored, nodes=merged), res)

    def undo_provision(self, p: Provisioning, exc: BaseException) -> None:
        if p.made:
            self._release(p.name, p.made)

    def provisioned(self, p: Provisioning, handle: ClusterHandle) -> ClusterHandle:
        """Claims of hosts a cluster made meanwhile did not take are given back; a new cluster's agents."""
        used = {(n.extra.get("host"), int(n.extra.get("port", 0))) for n in handle.nodes}
        spare = [pr for pr in p.made if (pr.host, pr.port) not in used]  # joined a cluster made meanwhile
        if spare:
            self._release(p.name, spare)
        if p.fresh and self.settings.node_agent:
            return self.agents.start_recorded(handle, self.records(p.name))
        return handle

    # -- node agents ------------------------------------------------------------------------------

    def agent_endpoint(self, handle: ClusterHandle) -> tuple[str, int, bytes] | None:
        """The head agent's address (the handle's) and the token: cached in this process, else read
        from the head host (one call)."""
        return self.agents.endpoint(handle)

    def forget_agent(self, handle: ClusterHandle) -> None:
        self.agents.forget(handle)

    def replace_nodes(self, handle: ClusterHandle, ranks: Sequence[int]) -> ClusterHandle:
        """A lost host's rank goes to the first spare host (``spare_hosts``) that answers, has what the
        cluster was provisioned with and is in no node of the cluster; the record on the head names it,
        so the teardown cleans it too. The head cannot be replaced: it keeps the record."""
        if not self.spares:
            raise BackendError(
                "no spare host: list hosts kept aside for lost ones in the connection's spare_hosts extra"
            )
        return self._replace_in_record(handle, ranks, "on the head")

    def pick_replacements(
        self, name: str, record: dict[str, Any], handle: ClusterHandle, todo: list[int]
    ) -> dict[int, Node]:
        current = ClusterHandle.from_dict(record)
        res = recorded_resources(current) or Resources()
        used = {(n.extra.get("host"), int(n.extra.get("port", 0))) for n in current.nodes}
        count = len((record.get("extra") or {}).get("replaced", []))
        new: dict[int, Node] = {}
        for rank in todo:
            seen = handle.nodes[rank]
            if (seen.extra.get("host"), int(seen.extra.get("port", 0))) == self.head:
                raise BackendError(
                    f"rank {rank}'s host is the head {self.head[0]}:{self.head[1]}, which keeps the "
                    "cluster record: a lost head cannot be replaced"
                )
            why: list[str] = []
            for spare in self.spares:
                if spare in used:
                    continue
                try:
                    probe = self._probe(spare)
                except Exception as exc:
                    why.append(f"{self._name(spare)}: not usable ({exc})")
                    continue
                misfit = self._misfit(res, probe)
                if misfit:
                    why.append(f"{self._name(spare)}: {misfit[1]}")
                    continue
                try:
                    self._claim(name, [probe])
                except BackendError as exc:
                    why.append(f"{self._name(spare)}: {exc}")
                    continue
                count += 1
                new[rank] = replace(self._node(rank, name, probe, res), node_id=f"node-{rank}-spare{count}")
                used.add(spare)
                break
            else:
                raise BackendError(
                    f"no spare host left for rank {rank} (spare_hosts: {len(self.spares)}, "
                    f"{len(self.spares) - len(why)} in use by this cluster)"
                    + (": " + "; ".join(why) if why else "")
                )
        return new

    def replaced(
        self, old: ClusterHandle, new: ClusterHandle, ranks: Sequence[int], lost: list[Node]
    ) -> ClusterHandle:
        self._agents_for_replaced(old, new, ranks)
        return new

    def _agents_for_replaced(self, old: ClusterHandle, new: ClusterHandle, ranks: Sequence[int]) -> None:
        """The agent of each host that took a lost host's rank joins the head (the gang's next start
        through the head names it); without one the cluster's start takes the per-node path."""
        where = endpoint(new.extra)
        if where is None:
            return
        found = self.agent_endpoint(new)
        if found is None:
            return
        for rank in ranks:
            node = new.nodes[rank]
            if node.node_id != old.nodes[rank].node_id and rank > 0:
                self.agents.start_one(node, new.nodes[0], where, found[2])

    # -- teardown: the sequence is Backend's. The record on the head is updated first (the lease
    # released, or the teardown marked) and only then is anything killed: a teardown that cannot update
    # it (the head's record lock held, the head unreachable, the record unreadable) deletes nothing on
    # any node, since another run's lease may be in the record and the nodes are known only from it. A
    # node directory that another cluster of this name owns (``claim``) is left alone, and the node is
    # kept in the record as not cleaned.

    record_errors = (BackendError, RunnerError, ValueError)  # ValueError: a record that is not JSON

    def teardown_refused(
        self,
        name: str,
        holder: str | None,
        read: bool,
        idle_only: bool,
        record: Mapping[str, Any] | None,
        exc: Exception,
    ) -> BackendError:
        return BackendError(
            f"cluster {name!r}: the teardown could not update its record on the head "
            f"{self.head[0]}:{self.head[1]} ({exc}), so nothing was deleted on any node: another run "
            "may still hold the cluster. It is kept as it was; tear it down again once the head "
            "answers and its record can be written (or let its idle_down end it)"
        )

    def delete_nodes(self, name: str, nodes: list[Node], grace: float) -> dict[str, str]:
        script = TEARDOWN_GUARD + runtime.teardown_script()
        owner = self._owner(name)

        def one(node: Node) -> None:
            # a hung node must not hang the teardown: it has to greet within the connect timeout
            wait_for_ssh(
                node.extra["host"], int(node.extra["port"]), self.settings.connect_timeout, max_delay=0.5
            )
            args = [owner, f"{grace:.3f}", node.root]
            res = self.runner(node).run_script(script, args, timeout=grace + 60)
            if res.returncode != 0:
                raise BackendError(f"teardown failed: {res.error_text or f'exit code {res.returncode}'}")
            if res.text.startswith("NOT_OURS"):  # kept as unclean: whatever of ours is there stays named
                other = res.text[len("NOT_OURS") :].strip().split(" ")[0] or "an unknown head"
                raise BackendError(
                    f"{node.root} belongs to another cluster of this name, whose record is on {other}: "
                    "left alone"
                )

        unclean = {
            n.node_id: unclean_reason(n, e)
            for n, e in zip(nodes, self._map(one, nodes), strict=True)
            if isinstance(e, Exception)
        }
        for reason in unclean.values():
            log.warning(
                "cluster %s: a node could not be cleaned (%s); it stays in the cluster record and the "
                "next teardown retries it",
                name,
                reason,
            )
        return unclean
