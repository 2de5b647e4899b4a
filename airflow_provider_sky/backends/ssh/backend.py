"""Gangs on existing machines over SSH: the hosts are given, "provisioning" checks and reserves them.

A cluster is a named set of hosts. Its record (rank order, resolved homes, leases) is kept on the head
node (``backends.headrecord``). Each node's runtime directory is ``~/.sky_airflow/<cluster>``; teardown
kills everything under it and removes it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import socket
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from airflow_provider_sky import runtime
from airflow_provider_sky.backends.base import (
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
    nodes_to_clean,
    teardown_result,
    unclean_reason,
)
from airflow_provider_sky.backends.headrecord import HeadRecords, record_path
from airflow_provider_sky.backends.ssh.config import DEFAULT_MAX_PARALLEL, parse_ssh_config
from airflow_provider_sky.gang import rank_order
from airflow_provider_sky.runners.ssh import SSHNodeConfig, SSHRunner, wait_for_ssh
from airflow_provider_sky.runners.ssh.config import is_policy
from airflow_provider_sky.spec import BackendCapabilities, TaskSpec

log = logging.getLogger(__name__)

_HOME_SCRIPT = 'printf "%s\\n" "$HOME"; nproc 2>/dev/null || echo 0; ' + (
    "awk '/MemTotal/ {print $2}' /proc/meminfo 2>/dev/null || echo 0"
)


@dataclass(frozen=True)
class HostProbe:
    """What provisioning learned of one host: where its home is and how big it is."""

    host: str
    port: int
    home: str
    cpus: int
    mem_kb: int


def _split_user(entry: str, default_user: str) -> tuple[str, str]:
    """``user@host...`` → (user, rest); hosts may each have their own user."""
    entry = entry.strip()
    if "@" in entry:
        user, _, rest = entry.partition("@")
        return user, rest
    return default_user, entry


def _split_host(entry: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` → (host, port)."""
    entry = entry.strip()
    if entry.startswith("["):
        host, _, rest = entry[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else default_port
    if entry.count(":") == 1:
        host, port = entry.split(":")
        return host, int(port)
    return entry, default_port


def _resolve_ip(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return str(socket.getaddrinfo(host, None)[0][4][0])


class SSHBackend(Backend):
    """Existing machines reached over SSH (paramiko), one rank per host."""

    kind = "ssh"
    #: how the head's cluster records are locked: ``auto`` (``flock`` if the head has it) or ``mkdir``
    record_lock = "auto"

    def __init__(
        self,
        hosts: Sequence[str],
        *,
        user: str,
        port: int = 22,
        head: str | None = None,
        private_key: str | None = None,
        key_file: str | None = None,
        passphrase: str | None = None,
        host_key_policy: str = "verify",
        known_hosts: str | None = None,
        pinned_host_keys: Mapping[str, str] | Sequence[str] = (),
        connect_timeout: float = 10.0,
        ready_timeout: float = 30.0,
        max_parallel: int = DEFAULT_MAX_PARALLEL,
    ) -> None:
        if not hosts:
            raise BackendError(
                "hosts: the SSH connection lists no hosts; give them head first, comma-separated"
            )
        self.users: dict[tuple[str, int], str] = {}
        self.endpoints = []
        for entry in hosts:
            host_user, rest = _split_user(entry, user)
            endpoint = _split_host(rest, port)
            if not host_user:
                raise BackendError(
                    f"login: no user for host {rest!r}; set the connection's login or write user@host"
                )
            if endpoint in self.users:
                raise BackendError(
                    f"hosts: {rest!r} is listed twice; list each host once (one rank runs per host)"
                )
            self.users[endpoint] = host_user
            self.endpoints.append(endpoint)
        self.user = user
        self.head = _split_host(_split_user(head, user)[1], port) if head else self.endpoints[0]
        if self.head not in self.endpoints:
            raise BackendError(f"head: {head!r} is not one of the hosts {list(hosts)}")
        if not is_policy(host_key_policy):
            raise BackendError(
                f"host_key_policy: {host_key_policy!r} is not one of verify, accept-new, skip "
                "(verify is the default; skip turns host-key checks off and logs a warning)"
            )
        if private_key and key_file:
            raise BackendError(
                "private key: both a key text (the password field or the private_key extra) and key_file "
                "are given; keep one (the Airflow SSH provider refuses the same: key_file and private_key "
                "both provided)"
            )
        self.private_key = private_key
        self.key_file = key_file
        self.passphrase = passphrase
        self.host_key_policy = host_key_policy
        self.known_hosts = known_hosts
        self.pinned = pinned_host_keys
        self.connect_timeout = connect_timeout
        self.ready_timeout = ready_timeout
        self.max_parallel = max(1, int(max_parallel))
        self.capabilities = BackendCapabilities(
            name="ssh",
            max_nodes=len(self.endpoints),
            supported_resources=frozenset({"cpus", "memory", "labels", "cloud"}),
            clouds=frozenset({"ssh"}),
        )
        self._runners: dict[tuple[str, int], SSHRunner] = {}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> SSHBackend:
        """From a ``sky_ssh`` connection (see ``config.parse_ssh_config``)."""
        s = parse_ssh_config(config)
        return cls(
            s.hosts,
            user=s.user,
            port=s.port,
            head=s.head,
            private_key=s.private_key,
            key_file=s.key_file,
            passphrase=s.passphrase,
            host_key_policy=s.host_key_policy,
            known_hosts=s.known_hosts,
            pinned_host_keys=s.pinned_host_keys,
            connect_timeout=s.connect_timeout,
            ready_timeout=s.ready_timeout,
            max_parallel=s.max_parallel,
        )

    def test_connection(self) -> str:
        """Every host greets, shows a host key that checks out and accepts the key; nothing is run."""

        def one(endpoint: tuple[str, int]) -> None:
            wait_for_ssh(*endpoint, self.connect_timeout, max_delay=0.5)
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
        if isinstance(self.pinned, Mapping):
            v = self.pinned.get(f"{host}:{port}") or self.pinned.get(host) or ()
            return (v,) if isinstance(v, str) else tuple(v)
        return tuple(self.pinned)

    def _config(self, host: str, port: int) -> SSHNodeConfig:
        return SSHNodeConfig(
            host,
            user=self.users.get((host, port), self.user),
            port=port,
            private_key=self.private_key,
            key_file=self.key_file,
            passphrase=self.passphrase,
            host_key_policy=self.host_key_policy,
            known_hosts=self.known_hosts,
            pinned_host_keys=self._pins_for(host, port),
            connect_timeout=self.connect_timeout,
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

    @property
    def records(self) -> HeadRecords:
        """The cluster records, on the head host."""
        return HeadRecords(self._head_runner, self.head[0], self.record_lock)

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        """The cluster record, kept on the head (rank 0's node)."""
        return [f"{handle.nodes[0].home}/{record_path(handle.name)}"] if rank == 0 else []

    def find(self, name: str) -> ClusterHandle | None:
        record = self.records.load(name)
        return ClusterHandle.from_dict(record) if record is not None else None

    # -- lifecycle --------------------------------------------------------------------------------

    def _probe(self, endpoint: tuple[str, int]) -> HostProbe:
        host, port = endpoint
        wait_for_ssh(host, port, self.ready_timeout)
        res = self._runner_for(host, port).run_script(_HOME_SCRIPT, timeout=self.connect_timeout + 20)
        if res.returncode != 0:
            raise BackendError(f"{self.users[endpoint]}@{host}:{port}: probe failed: {res.error_text}")
        lines = res.text.split("\n")
        return HostProbe(host, port, lines[0].strip(), int(lines[1] or 0), int(lines[2] or 0))

    def provision(self, name: str, spec: TaskSpec, holder: str | None = None) -> ClusterHandle:
        """Check every host answers and authenticates before anything runs; keep a stored rank order."""
        runtime.check_job_id(name)
        if spec.num_nodes > len(self.endpoints):
            raise BackendError(
                f"num_nodes: the task asks for {spec.num_nodes} nodes but the SSH connection has "
                f"{len(self.endpoints)} hosts; add hosts or lower num_nodes"
            )
        return self._wait_out_teardown(lambda: self._provision_once(name, spec, holder), 0.5)

    def _provision_once(self, name: str, spec: TaskSpec, holder: str | None) -> ClusterHandle:
        text = self.records.read(name)
        if text is not None:
            existing = json.loads(text)
            check_reusable(existing, name, spec.num_nodes)
            chosen = [
                (n.extra["host"], int(n.extra["port"])) for n in ClusterHandle.from_dict(existing).nodes
            ]
        else:
            resolved = {(_resolve_ip(h), p): (h, p) for h, p in self.endpoints}
            head = (_resolve_ip(self.head[0]), self.head[1])
            chosen = [resolved[k] for k in rank_order(list(resolved), head)][: spec.num_nodes]
        probes = self._map(self._probe, chosen)
        errors = [
            f"{h}:{p}: {e}" for (h, p), e in zip(chosen, probes, strict=True) if isinstance(e, Exception)
        ]
        if errors:
            raise BackendError("hosts not usable, nothing was started: " + "; ".join(errors))
        self._check_resources(spec, probes)
        # ``chosen`` (and so ``probes``) is in rank order: the stored order on reuse, else head first, then by IP
        nodes = [
            Node(
                ip=_resolve_ip(p.host),
                node_id=f"node-{i}",
                root=f"{p.home}/.sky_airflow/{name}",
                home=p.home,
                extra={"host": p.host, "port": p.port, "user": self.users[(p.host, p.port)]},
            )
            for i, p in enumerate(probes)
        ]
        fresh = ClusterHandle(name=name, backend=self.kind, nodes=tuple(nodes), cloud="ssh")

        def join(record: dict[str, Any] | None) -> tuple[dict[str, Any], ClusterHandle]:
            if record is None:
                return new_record(fresh, holder), fresh
            check_reusable(record, name, spec.num_nodes)  # it may have changed since it was read
            return add_lease(record, holder), ClusterHandle.from_dict(record)

        return self.records.update(name, join)

    def _check_resources(self, spec: TaskSpec, probes: Sequence[HostProbe]) -> None:
        """``cpus``/``memory`` on existing machines are checked, not ignored: too small is an error."""
        res = spec.resources
        for p in probes:
            if res.cpus and p.cpus and float(res.cpus.rstrip("+")) > p.cpus:
                raise BackendError(
                    f"resources.cpus: {p.host}:{p.port} has {p.cpus} CPUs, the task asks for {res.cpus}"
                )
            if res.memory and p.mem_kb and float(res.memory.rstrip("+")) * 1024 * 1024 > p.mem_kb * 1.05:
                raise BackendError(
                    f"resources.memory: {p.host}:{p.port} has {p.mem_kb / 1024 / 1024:.1f} GiB, the task "
                    f"asks for {res.memory} GiB"
                )

    def terminate(self, name: str, grace: float = 2.0, holder: str | None = None) -> Teardown:
        def begin(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
            if record is None:
                return None, None
            new, kept_for = begin_teardown(record, holder)
            return new, (new, kept_for)

        begun = self.records.update(name, begin)
        if begun is None:
            return Teardown(removed=False)
        record, kept_for = begun
        if kept_for:
            log.info("cluster %s kept: still held by %s", name, ", ".join(kept_for))
            return Teardown(removed=False, kept_for=kept_for)
        nodes = nodes_to_clean(record)
        script = runtime.teardown_script()

        def one(node: Node) -> None:
            # a hung node must not hang the teardown: it has to greet within the connect timeout
            wait_for_ssh(node.extra["host"], int(node.extra["port"]), self.connect_timeout, max_delay=0.5)
            res = self.runner(node).run_script(script, [f"{grace:.3f}", node.root], timeout=grace + 60)
            if res.returncode != 0:
                raise BackendError(f"teardown failed: {res.error_text or f'exit code {res.returncode}'}")

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
        self.records.update(name, lambda record: (finish_teardown(record, unclean), None))
        return teardown_result(unclean, nodes)
