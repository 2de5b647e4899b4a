"""Gangs on existing machines over SSH: the hosts are given, "provisioning" checks and reserves them.

A cluster is a named set of hosts. Its record (rank order, resolved homes, leases: see ``backends.base``)
is kept on the head node in ``~/.sky_airflow/clusters/<name>.json``, so any worker that can reach the head
finds it. The record changes by compare-and-swap: one remote script, under ``flock`` on the head (a
``mkdir`` lock where ``flock`` is missing), writes the new record only if the file still holds what was
read; otherwise it returns the current one and the change is made again on that. Each node's runtime
directory is ``~/.sky_airflow/<cluster>``; teardown kills everything under it and removes it.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import random
import re
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

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
from airflow_provider_sky.gang import rank_order
from airflow_provider_sky.runners.ssh import SSHNodeConfig, SSHRunner, wait_for_ssh
from airflow_provider_sky.spec import BackendCapabilities, TaskSpec

log = logging.getLogger(__name__)

#: default bound on hosts contacted at once (connections are then reused)
DEFAULT_MAX_PARALLEL = 32

_HOME_SCRIPT = 'printf "%s\\n" "$HOME"; nproc 2>/dev/null || echo 0; ' + (
    "awk '/MemTotal/ {print $2}' /proc/meminfo 2>/dev/null || echo 0"
)
_READ_SCRIPT = '[ -f "$1" ] && cat "$1"; exit 0'
#: compare-and-swap of a cluster record on the head: $1 record path (relative to $HOME), $2 "1" if the
#: record was there when read, $3 "1" to write the new record ("0" deletes it), $4 lock kind (auto|mkdir).
#: Prints OK, or CONFLICT and the current record. __OLD__ / __NEW__ are quoted here-documents.
_CAS_SCRIPT = r"""
rec="$HOME/$1"; had=$2; put=$3; d=$(dirname "$rec")
mkdir -p "$d" || exit 3
if [ "$4" != mkdir ] && command -v flock >/dev/null 2>&1; then
  exec 9>>"$d/.lock"
  flock -w 60 9 || { echo "the cluster records' lock $d/.lock is held for over 60s" >&2; exit 3; }
else
  n=0
  while ! mkdir "$d/.lockd" 2>/dev/null; do
    p=; read -r p < "$d/.lockd/pid" 2>/dev/null || true
    if [ -n "$p" ] && ! kill -0 "$p" 2>/dev/null; then rm -rf "$d/.lockd"; continue; fi
    n=$((n + 1))
    [ "$n" -lt 600 ] || { echo "the cluster records' lock $d/.lockd is held for over 60s" >&2; exit 3; }
    sleep 0.1
  done
  trap 'rm -rf "$d/.lockd"' EXIT
  trap 'exit 1' HUP INT TERM
  echo $$ > "$d/.lockd/pid"
fi
has=0; cur=
if [ -f "$rec" ]; then has=1; cur=$(cat "$rec") || exit 3; fi
old=$(cat <<'__OLD_EOF__'
__OLD__
__OLD_EOF__
)
if [ "$has" != "$had" ] || [ "$cur" != "$old" ]; then
  echo CONFLICT
  [ "$has" = 1 ] && printf '%s\n' "$cur"
  exit 0
fi
if [ "$put" = 1 ]; then
  umask 077
  cat > "$rec.tmp" <<'__NEW_EOF__' || exit 3
__NEW__
__NEW_EOF__
  mv "$rec.tmp" "$rec" || exit 3
else
  rm -f "$rec"
fi
echo OK
"""

T = TypeVar("T")


def _cas_script(old: str | None, new: dict[str, Any] | None) -> str:
    """The compare-and-swap script with the expected and the new record inlined (never on a command line)."""
    new_text = json.dumps(new, indent=1) if new is not None else ""
    while True:  # a delimiter line that neither text holds
        tag = secrets.token_hex(6)
        if tag not in (old or "") and tag not in new_text:
            break
    parts = {
        "__OLD_EOF__": f"SKY_OLD_{tag}",
        "__NEW_EOF__": f"SKY_NEW_{tag}",
        "__OLD__": old or "",
        "__NEW__": new_text,
    }
    # one pass over the template: text put in (holder ids are user text) is never scanned again
    return re.sub(r"__(?:OLD|NEW)(?:_EOF)?__", lambda m: parts[m.group(0)], _CAS_SCRIPT)


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


def _number(config: Mapping[str, Any], key: str, default: Any, kind: Any) -> Any:
    """A numeric connection field, or an error naming it (``port: 'ssh' is not a number``)."""
    raw = config.get(key)
    if raw in (None, ""):
        return default
    try:
        value = kind(raw)
    except (TypeError, ValueError):
        raise BackendError(f"{key}: {raw!r} is not a number; fix the connection field") from None
    if value <= 0:
        raise BackendError(f"{key}: must be positive, got {raw!r}")
    return value


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
        if host_key_policy not in ("verify", "accept-new", "skip"):
            raise BackendError(
                f"host_key_policy: {host_key_policy!r} is not one of verify, accept-new, skip "
                "(verify is the default; skip turns host-key checks off and logs a warning)"
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
        """From a ``sky_ssh`` connection: host = hosts (comma-separated), login, port, password = key text."""
        hosts = config.get("hosts") or config.get("host") or ""
        if isinstance(hosts, str):
            hosts = [h for h in (p.strip() for p in hosts.replace("\n", ",").split(",")) if h]
        pinned = config.get("pinned_host_keys") or config.get("host_keys") or ()
        if isinstance(pinned, str):
            pinned = [line for line in pinned.splitlines() if line.strip()]
        return cls(
            hosts,
            user=config.get("login") or config.get("user") or "",
            port=_number(config, "port", 22, int),
            head=config.get("head"),
            private_key=config.get("private_key") or config.get("password"),
            key_file=config.get("key_file"),
            passphrase=config.get("private_key_passphrase"),
            host_key_policy=config.get("host_key_policy", "verify"),
            known_hosts=config.get("known_hosts"),
            pinned_host_keys=pinned,
            connect_timeout=_number(config, "connect_timeout", 10.0, float),
            ready_timeout=_number(config, "ready_timeout", 30.0, float),
            max_parallel=_number(config, "max_parallel", DEFAULT_MAX_PARALLEL, int),
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
            host_key_policy=self.host_key_policy,  # type: ignore[arg-type]
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

    def _record_path(self, name: str) -> str:
        runtime.check_job_id(name)
        return f".sky_airflow/clusters/{name}.json"

    def _read_record(self, name: str) -> str | None:
        """The record's text on the head (trailing newlines dropped, as the swap script compares it)."""
        res = self._head_runner().run_script(_READ_SCRIPT, [self._record_path(name)], timeout=30)
        if res.returncode != 0:
            raise BackendError(
                f"reading the cluster record on the head {self.head[0]} failed: {res.error_text}"
            )
        text = res.text.rstrip("\n")
        return text if text.strip() else None

    def idle_down_paths(self, handle: ClusterHandle, rank: int) -> list[str]:
        """The cluster record, kept on the head (rank 0's node)."""
        return [f"{handle.nodes[0].home}/{self._record_path(handle.name)}"] if rank == 0 else []

    def find(self, name: str) -> ClusterHandle | None:
        text = self._read_record(name)
        return ClusterHandle.from_dict(json.loads(text)) if text is not None else None

    def _update(
        self, name: str, change: Callable[[dict[str, Any] | None], tuple[dict[str, Any] | None, T]]
    ) -> T:
        """Apply ``change`` (record → new record, result) atomically on the head; return its result.

        Compare-and-swap: the new record is written only if the head still holds the record ``change``
        saw; otherwise ``change`` runs again on the current one. A new record of None deletes it.
        """
        text = self._read_record(name)
        for _ in range(100):
            current = json.loads(text) if text is not None else None
            new, result = change(current)
            if new == current:
                return result
            script = _cas_script(text, new)
            args = [self._record_path(name), "1" if text is not None else "0", "1" if new else "0"]
            res = self._head_runner().run_script(script, [*args, self.record_lock], timeout=90)
            out = res.text
            if res.returncode != 0 or not out.startswith(("OK", "CONFLICT")):
                raise BackendError(
                    f"updating the cluster record {name!r} on the head {self.head[0]} failed: "
                    f"{res.error_text or out.strip() or f'exit code {res.returncode}'}"
                )
            if out.startswith("OK"):
                return result
            text = out[len("CONFLICT") :].strip("\n") or None  # someone changed it: redo on theirs
            time.sleep(random.uniform(0, 0.05))
        raise BackendError(f"the cluster record {name!r} on {self.head[0]} kept changing; retry")

    # -- lifecycle --------------------------------------------------------------------------------

    def _probe(self, endpoint: tuple[str, int]) -> tuple[str, int, str, int, int]:
        host, port = endpoint
        wait_for_ssh(host, port, self.ready_timeout)
        res = self._runner_for(host, port).run_script(_HOME_SCRIPT, timeout=self.connect_timeout + 20)
        if res.returncode != 0:
            raise BackendError(f"{self.users[endpoint]}@{host}:{port}: probe failed: {res.error_text}")
        lines = res.text.split("\n")
        return host, port, lines[0].strip(), int(lines[1] or 0), int(lines[2] or 0)

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
        text = self._read_record(name)
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
                ip=_resolve_ip(host),
                node_id=f"node-{i}",
                root=f"{home}/.sky_airflow/{name}",
                home=home,
                extra={"host": host, "port": port, "user": self.users[(host, port)]},
            )
            for i, (host, port, home, _, _) in enumerate(probes)
        ]
        fresh = ClusterHandle(name=name, backend=self.kind, nodes=tuple(nodes), cloud="ssh")

        def join(record: dict[str, Any] | None) -> tuple[dict[str, Any], ClusterHandle]:
            if record is None:
                return new_record(fresh, holder), fresh
            check_reusable(record, name, spec.num_nodes)  # it may have changed since it was read
            return add_lease(record, holder), ClusterHandle.from_dict(record)

        return self._update(name, join)

    def _check_resources(self, spec: TaskSpec, probes: Sequence[Any]) -> None:
        """``cpus``/``memory`` on existing machines are checked, not ignored: too small is an error."""
        res = spec.resources
        for host, port, _, cpus, mem_kb in probes:
            if res.cpus and cpus and float(res.cpus.rstrip("+")) > cpus:
                raise BackendError(
                    f"resources.cpus: {host}:{port} has {cpus} CPUs, the task asks for {res.cpus}"
                )
            if res.memory and mem_kb and float(res.memory.rstrip("+")) * 1024 * 1024 > mem_kb * 1.05:
                raise BackendError(
                    f"resources.memory: {host}:{port} has {mem_kb / 1024 / 1024:.1f} GiB, the task asks for "
                    f"{res.memory} GiB"
                )

    def sync_files(self, handle: ClusterHandle, spec: TaskSpec) -> None:
        def one(node: Node) -> None:
            r = self.runner(node)
            if spec.workdir:
                r.put_tree(spec.workdir, f"{node.home}/sky_workdir")
            for dest, src in spec.file_mounts.items():
                target = f"{node.home}/{dest[2:]}" if dest.startswith("~/") else dest
                if Path(src).is_dir():
                    r.put_tree(src, target)
                else:
                    r.put_file(src, target)

        errors = [
            f"{n.ip}: {e}" for n, e in zip(handle.nodes, self._map(one, list(handle.nodes)), strict=True) if e
        ]
        if errors:
            raise BackendError("copying workdir/file_mounts failed: " + "; ".join(errors))

    def terminate(self, name: str, grace: float = 2.0, holder: str | None = None) -> Teardown:
        def begin(record: dict[str, Any] | None) -> tuple[dict[str, Any] | None, Any]:
            if record is None:
                return None, None
            new, kept_for = begin_teardown(record, holder)
            return new, (new, kept_for)

        begun = self._update(name, begin)
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
        self._update(name, lambda record: (finish_teardown(record, unclean), None))
        return teardown_result(unclean, nodes)
