"""A ``sky_ssh`` connection read into settings: one plain function, no SSH library, tested as a matrix.

Where one setting can come from two places (a standard field and an extra, or two spellings), giving both
with different values is an error naming both, never a silent choice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.nodeagents import agents_on
from airflow_provider_sky.node.accelerators import Inventory, declared_inventory
from airflow_provider_sky.runners.ssh.config import HostKeyPolicy, is_policy

#: default bound on hosts contacted at once (connections are then reused)
DEFAULT_MAX_PARALLEL = 32


@dataclass(frozen=True)
class SSHSettings:
    """What an SSH backend is built from."""

    hosts: tuple[str, ...]
    user: str
    port: int = 22
    head: str | None = None
    private_key: str | None = None
    key_file: str | None = None
    passphrase: str | None = None
    host_key_policy: str = "verify"
    known_hosts: str | None = None
    pinned_host_keys: Mapping[str, str] | Sequence[str] = field(default_factory=tuple)
    connect_timeout: float = 10.0
    ready_timeout: float = 30.0
    max_parallel: int = DEFAULT_MAX_PARALLEL
    #: the hosts' GPUs as declared: ``"H100:8"`` for every host, or ``{host: "H100:8"}`` (JSON text or a
    #: mapping); hosts not declared are asked with nvidia-smi / rocm-smi at provision
    accelerators: Any = None
    #: hosts kept aside: one takes the rank of a host lost during a gang with retries (``spare_hosts``)
    spare_hosts: tuple[str, ...] = ()
    #: start a node agent on each host that has python3 (``backends/nodeagents.py``); off: the
    #: per-node path only (``node_agent: false``)
    node_agent: bool = True


def _given(value: Any) -> bool:
    return value not in (None, "")


def one_of(config: Mapping[str, Any], *keys: str, what: str) -> Any:
    """The value of whichever of ``keys`` is set; two set to different values is an error."""
    found = [(k, config[k]) for k in keys if _given(config.get(k))]
    if len({repr(v) for _, v in found}) > 1:
        names = " and ".join(k for k, _ in found)
        raise BackendError(f"{names}: both give the {what}, with different values; keep one of them")
    return found[0][1] if found else None


#: a control character (newline, carriage return, NUL, ...): never part of a name
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def name_value(value: Any, key: str) -> str | None:
    """A name-like connection field (a user, host, region, context ...) as given, or an error naming it:
    a name pasted with a newline, a carriage return or spaces at an end would fail later, on a node."""
    if value in (None, ""):
        return None
    text = str(value)
    if text != text.strip() or _CONTROL.search(text):
        raise BackendError(
            f"{key}: {text!r} has spaces at an end or a control character (newline, carriage return, "
            "NUL, ...); remove them from the connection field"
        )
    return text


def number(config: Mapping[str, Any], key: str, default: Any, kind: Any) -> Any:
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


def _hosts(raw: Any) -> tuple[str, ...]:
    if isinstance(raw, str):
        return tuple(h for h in (p.strip() for p in raw.replace("\n", ",").split(",")) if h)
    return tuple(str(h).strip() for h in raw or () if str(h).strip())


def _pins(raw: Any) -> Mapping[str, str] | Sequence[str]:
    if isinstance(raw, str):
        return tuple(line for line in raw.splitlines() if line.strip())
    if isinstance(raw, Mapping):
        return dict(raw)
    return tuple(raw or ())


def parse_ssh_config(config: Mapping[str, Any]) -> SSHSettings:
    """Settings from a ``sky_ssh`` connection: host = hosts (comma-separated, head first), login, port,
    password = private key text; the rest are extras (``hooks`` merged a reused ``ssh`` connection in)."""
    private_key = one_of(config, "password", "private_key", what="private key text")
    hosts = _hosts(one_of(config, "host", "hosts", what="hosts"))
    for host in hosts:
        name_value(host, "host")
    return SSHSettings(
        hosts=hosts,
        user=name_value(one_of(config, "login", "user", what="user"), "login") or "",
        port=number(config, "port", 22, int),
        head=name_value(config.get("head"), "head"),
        private_key=private_key,
        key_file=config.get("key_file") or None,
        passphrase=config.get("private_key_passphrase") or None,
        host_key_policy=config.get("host_key_policy") or "verify",
        known_hosts=config.get("known_hosts") or None,
        pinned_host_keys=_pins(one_of(config, "pinned_host_keys", "host_keys", what="pinned host keys")),
        connect_timeout=number(config, "connect_timeout", 10.0, float),
        ready_timeout=number(config, "ready_timeout", 30.0, float),
        max_parallel=number(config, "max_parallel", DEFAULT_MAX_PARALLEL, int),
        accelerators=config.get("accelerators"),
        spare_hosts=_spares(config.get("spare_hosts")),
        node_agent=agents_on(config),
    )


def _spares(raw: Any) -> tuple[str, ...]:
    """``spare_hosts``: like ``host``, a comma-separated list (or a JSON list); anything else is named."""
    if raw in (None, ""):
        return ()
    if not isinstance(raw, (str, list, tuple)):
        raise BackendError(
            f'spare_hosts: expected hosts as a comma-separated text or a list (e.g. "10.0.0.9,10.0.0.10"), '
            f"got {raw!r}"
        )
    spares = _hosts(raw)
    for host in spares:
        name_value(host, "spare_hosts")
    return spares


#: the settings that together say how to authenticate: taken from one place only
_KEY_SETTINGS = ("private_key", "password", "key_file", "private_key_passphrase")


def merge_ssh_connection(config: Mapping[str, Any], ssh_conn: Any) -> dict[str, Any]:
    """Fill what a ``sky_ssh`` connection leaves empty from a standard ``ssh`` connection (not asked twice).

    The ``ssh`` connection's host (comma-separated hosts allowed), login, port, ``private_key``/``key_file``
    extras (read as the SSH provider reads them: its password field is a login password, not a key) and
    pinned ``host_key`` are used. The ``sky_ssh`` settings win; the key is taken as a whole from one of the
    two connections (the ``sky_ssh`` one if it gives any), never a key text from one and a file from the
    other.
    """
    extra = dict(ssh_conn.extra_dejson)
    if extra.get("private_key") and extra.get("key_file"):
        raise BackendError(
            f"ssh_conn_id: the ssh connection {config.get('ssh_conn_id')!r} gives both key_file and "
            "private_key; keep one (the SSH provider refuses it too)"
        )
    theirs: dict[str, Any] = {
        "host": ssh_conn.host,
        "login": ssh_conn.login,
        "port": ssh_conn.port,
        "pinned_host_keys": extra.get("host_key"),
    }
    if not any(_given(config.get(k)) for k in _KEY_SETTINGS):
        theirs.update(
            private_key=extra.get("private_key"),
            key_file=extra.get("key_file"),
            private_key_passphrase=extra.get("private_key_passphrase"),
        )
    if str(extra.get("no_host_key_check", "")).lower() == "true":
        theirs["host_key_policy"] = "skip"
    given = {k for k, v in config.items() if _given(v)}
    for ours, alias in (("host", "hosts"), ("login", "user"), ("pinned_host_keys", "host_keys")):
        if alias in given:
            theirs.pop(ours)
    merged = {k: v for k, v in theirs.items() if _given(v)}
    merged.update({k: v for k, v in config.items() if _given(v)})
    return merged


@dataclass(frozen=True)
class HostLayout:
    """The hosts of :class:`SSHSettings` as endpoints: what the backend addresses, checked once."""

    #: ``(host, port)`` in rank order, head first unless ``head`` says otherwise
    endpoints: list[tuple[str, int]]
    #: the user of every endpoint (hosts and spares: ``user@host`` or the connection's login)
    users: dict[tuple[str, int], str]
    spares: list[tuple[str, int]]
    head: tuple[str, int]
    #: the GPUs declared per endpoint (the ``accelerators`` extra)
    declared: dict[tuple[str, int], Inventory]
    #: ``host_key_policy``, checked
    policy: HostKeyPolicy


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


def host_layout(s: SSHSettings) -> HostLayout:
    """Split every ``[user@]host[:port]`` entry of ``s``; an error names the field and the fix (no user, a
    host listed twice, a head that is not a host, an unknown host-key policy, two keys, bad GPUs)."""
    if not s.hosts:
        raise BackendError("hosts: the SSH connection lists no hosts; give them head first, comma-separated")
    users: dict[tuple[str, int], str] = {}
    endpoints: list[tuple[str, int]] = []
    names: dict[str, tuple[str, int]] = {}  # every way the accelerators extra may name a host
    for entry in s.hosts:
        host_user, rest = _split_user(entry, s.user)
        endpoint = _split_host(rest, s.port)
        if not host_user:
            raise BackendError(
                f"login: no user for host {rest!r}; set the connection's login or write user@host"
            )
        if endpoint in users:
            raise BackendError(
                f"hosts: {rest!r} is listed twice; list each host once (one rank runs per host)"
            )
        users[endpoint] = host_user
        endpoints.append(endpoint)
        for alias in (
            entry.strip(),
            rest,
            endpoint[0],
            f"{endpoint[0]}:{endpoint[1]}",
            f"{host_user}@{rest}",
        ):
            names.setdefault(alias, endpoint)
    spares: list[tuple[str, int]] = []
    for entry in s.spare_hosts:
        host_user, rest = _split_user(entry, s.user)
        try:
            endpoint = _split_host(rest, s.port)
        except ValueError:
            raise BackendError(f"spare_hosts: {entry!r} is not host, host:port or user@host:port") from None
        if not host_user:
            raise BackendError(
                f"spare_hosts: no user for spare host {rest!r}; set the connection's login or write user@host"
            )
        if endpoint in users:
            raise BackendError(
                f"spare_hosts: {rest!r} is also in hosts (or listed twice); a spare is a host kept aside "
                "for a lost one, list it once"
            )
        users[endpoint] = host_user
        spares.append(endpoint)
    head = _split_host(_split_user(s.head, s.user)[1], s.port) if s.head else endpoints[0]
    if head not in endpoints:
        raise BackendError(f"head: {s.head!r} is not one of the hosts {list(s.hosts)}")
    policy = s.host_key_policy
    if not is_policy(policy):
        raise BackendError(
            f"host_key_policy: {s.host_key_policy!r} is not one of verify, accept-new, skip "
            "(verify is the default; skip turns host-key checks off and logs a warning)"
        )
    if s.private_key and s.key_file:
        raise BackendError(
            "private key: both a key text (the password field or the private_key extra) and key_file "
            "are given; keep one (the Airflow SSH provider refuses the same: key_file and private_key "
            "both provided)"
        )
    try:
        declared = declared_inventory(s.accelerators, "accelerators", tuple(names))
    except ValueError as exc:
        raise BackendError(str(exc)) from None
    by_endpoint: dict[tuple[str, int], Inventory] = {}
    for key, inv in declared.items():
        if key == "*":
            for ep in endpoints:
                by_endpoint.setdefault(ep, inv)
        else:
            by_endpoint[names[key]] = inv  # a host named explicitly wins over "*"
    return HostLayout(endpoints, users, spares, head, by_endpoint, policy)
