"""Run node scripts over SSH with paramiko, sharing one connection per host across the process.

Why a pool: a gang of N nodes is polled by many triggers and launched by a parallel fan-out; a fresh SSH
handshake per call would cost O(calls) handshakes and trip sshd's ``MaxStartups`` (10:30:100), which drops
unauthenticated connections at random once ten are in flight. So every (host, port, user, key) gets one
authenticated :class:`paramiko.Transport`, kept open and multiplexed (one channel per call), and handshakes
are bounded process-wide.

Why no Airflow import: backends and runners sit below the Airflow layer (see DESIGN.md).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import hmac
import io
import logging
import os
import re
import shlex
import signal
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import paramiko
from paramiko.channel import Channel
from paramiko.common import MSG_CHANNEL_REQUEST
from paramiko.message import Message

from airflow_provider_sky.runners.base import CALLS, CommandRunner, RunnerError, RunResult

log = logging.getLogger(__name__)

HostKeyPolicy = Literal["verify", "accept-new", "skip"]
_POLICIES = ("verify", "accept-new", "skip")

#: process-wide bound on SSH handshakes in flight (client CPU, and fan-out through one jump host)
MAX_CONCURRENT_HANDSHAKES = 8
_HANDSHAKES = threading.BoundedSemaphore(MAX_CONCURRENT_HANDSHAKES)
#: per-sshd bound: sshd's ``MaxStartups 10:30:100`` starts dropping at 10 unauthenticated connections and
#: learns of a finished login a little after the client does, so stay well below 10 (retries cover the rest,
#: e.g. other processes connecting to the same host)
MAX_HANDSHAKES_PER_HOST = 4
_HOST_HANDSHAKES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_HOST_HANDSHAKES_LOCK = threading.Lock()

#: threads for :meth:`SSHRunner.arun_script`; sized for a wide gang fan-out, not the CPU count
EXECUTOR_THREADS = 128

#: an unreferenced pooled transport is closed after this many idle seconds (triggers re-create runners)
IDLE_TTL = 60.0

_CHUNK = 65536


# --------------------------------------------------------------------------------------------- errors


class HostUnreachable(RunnerError):
    """Nothing answered SSH at host:port in time (node down, still booting, or wrong address)."""


class HostKeyError(RunnerError):
    """The server's host key could not be trusted; nothing was run on the host."""


class HostKeyMismatch(HostKeyError):
    """The server presented a key other than the one we know: re-keyed host or an interception."""

    def __init__(self, host: str, message: str, *, expected: tuple[str, ...], seen: str) -> None:
        super().__init__(host, message)
        self.expected = expected
        self.seen = seen


class UnknownHostKey(HostKeyError):
    """Policy ``verify`` and no known_hosts entry or pinned key for the host."""

    def __init__(self, host: str, message: str, *, seen: str) -> None:
        super().__init__(host, message)
        self.seen = seen


class AuthFailed(RunnerError):
    """The server rejected our private key for this user."""

    def __init__(self, host: str, message: str, *, user: str) -> None:
        super().__init__(host, message)
        self.user = user


class CommandTimeout(RunnerError):
    """The script did not finish within ``timeout``; its channel was closed."""


class CallAbandoned(RunnerError):
    """The caller of :meth:`SSHRunner.arun_script` was cancelled; the script was stopped."""


# --------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class SSHNodeConfig:
    """How to reach one node. Secrets (``private_key``, ``passphrase``) are kept out of ``repr``."""

    host: str
    _: dataclasses.KW_ONLY
    user: str
    port: int = 22
    #: private key TEXT (OpenSSH or PEM); takes precedence over ``key_file``
    private_key: str | None = field(default=None, repr=False)
    key_file: str | None = None
    passphrase: str | None = field(default=None, repr=False)
    host_key_policy: HostKeyPolicy = "verify"
    #: known_hosts path; ``None`` means ``~/.ssh/known_hosts`` (read if it exists; written by accept-new)
    known_hosts: str | None = None
    #: trusted host keys as ``"ssh-ed25519 AAAA... [comment]"`` lines
    pinned_host_keys: tuple[str, ...] = ()
    connect_timeout: float = 10.0
    keepalive: int = 15
    #: handshake attempts (exponential backoff between them) before HostUnreachable
    connect_attempts: int = 4
    #: channels used at once on the shared transport; sshd's default ``MaxSessions`` is 10
    max_sessions: int = 10

    def __post_init__(self) -> None:
        if self.host_key_policy not in _POLICIES:
            raise ValueError(f"host_key_policy must be one of {_POLICIES}, not {self.host_key_policy!r}")
        if not self.user:
            raise ValueError("user is required")
        if isinstance(self.pinned_host_keys, str):
            raise ValueError("pinned_host_keys must be a tuple of key lines, not one string")
        if self.connect_attempts < 1 or self.max_sessions < 1:
            raise ValueError("connect_attempts and max_sessions must be >= 1")

    @property
    def address(self) -> str:
        """``host:port`` for messages."""
        return f"{self.host}:{self.port}"

    @property
    def known_hosts_name(self) -> str:
        """The host's name in known_hosts: ``host``, or ``[host]:port`` off port 22 (OpenSSH's form)."""
        return self.host if self.port == 22 else f"[{self.host}]:{self.port}"

    def known_hosts_path(self) -> Path:
        return Path(self.known_hosts or "~/.ssh/known_hosts").expanduser()


# --------------------------------------------------------------------------------------------- keys


def _describe(key: paramiko.PKey) -> str:
    """``ssh-ed25519 SHA256:...``: what users compare with ``ssh-keygen -lf``."""
    return f"{key.get_name()} {key.fingerprint}"


def _same_key(a: paramiko.PKey, b: paramiko.PKey) -> bool:
    return a.asbytes() == b.asbytes()


def _parse_public_key(line: str) -> paramiko.PKey:
    """``"ssh-ed25519 AAAA... [comment]"`` (or a known_hosts line) -> PKey; raises ValueError on junk."""
    parts = line.split()
    if (
        len(parts) >= 3
        and not parts[0].startswith(("ssh-", "ecdsa-"))
        and parts[1].startswith(("ssh-", "ecdsa-"))
    ):
        parts = parts[1:]  # "host keytype base64": a line pasted from known_hosts
    if len(parts) < 2:
        raise ValueError(f"not a public key line: {line[:40]!r}")
    try:
        blob = base64.b64decode(parts[1], validate=True)
        return paramiko.PKey.from_type_string(parts[0], blob)
    except (binascii.Error, paramiko.SSHException, paramiko.pkey.UnknownKeyType, ValueError) as e:
        raise ValueError(f"not a usable {parts[0]} public key: {type(e).__name__}") from None


@functools.lru_cache(maxsize=512)
def _glob(pattern: str) -> re.Pattern[str]:
    """OpenSSH patterns know only ``*`` and ``?`` (``[`` is literal, as in ``[host]:port``)."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern))


def _host_pattern_matches(patterns: str, name: str) -> bool:
    """OpenSSH known_hosts host field: comma list of names, ``|1|`` hashes, wildcards, ``!`` negation."""
    matched = False
    for pattern in patterns.split(","):
        negated = pattern.startswith("!")
        pattern = pattern[1:] if negated else pattern
        if pattern.startswith("|1|"):
            try:
                _, _, salt_b64, digest_b64 = pattern.split("|")
                salt, digest = base64.b64decode(salt_b64), base64.b64decode(digest_b64)
            except ValueError:
                continue
            hit = hmac.compare_digest(hmac.new(salt, name.encode(), hashlib.sha1).digest(), digest)
        else:
            hit = _glob(pattern).fullmatch(name) is not None
        if hit and negated:
            return False
        matched = matched or hit
    return matched


def _known_host_keys(path: Path, name: str) -> tuple[list[paramiko.PKey], list[paramiko.PKey]]:
    """(trusted, revoked) keys for ``name`` in a known_hosts file; a missing file is empty."""
    trusted: list[paramiko.PKey] = []
    revoked: list[paramiko.PKey] = []
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return trusted, revoked
    for raw in text.splitlines():
        fields = raw.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if len(fields) < 3 or marker == "@cert-authority":
            continue
        if not _host_pattern_matches(fields[0], name):
            continue
        try:
            key = _parse_public_key(f"{fields[1]} {fields[2]}")
        except ValueError:
            continue
        (revoked if marker == "@revoked" else trusted).append(key)
    return trusted, revoked


_KNOWN_HOSTS_WRITE = threading.Lock()
_SKIP_WARNED: set[str] = set()
_SKIP_LOCK = threading.Lock()


def _append_known_host(cfg: SSHNodeConfig, key: paramiko.PKey) -> bool:
    """accept-new: record ``key`` unless another thread/process recorded one first. True if appended."""
    path = cfg.known_hosts_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _KNOWN_HOSTS_WRITE, open(path, "a+", encoding="utf-8") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            trusted, _ = _known_host_keys(path, cfg.known_hosts_name)
            if trusted:
                return False
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:
                fh.seek(fh.tell() - 1)
                if fh.read(1) != "\n":
                    fh.write("\n")
            fh.write(f"{cfg.known_hosts_name} {key.get_name()} {key.get_base64()}\n")
            fh.flush()
            return True
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _expected_keys(cfg: SSHNodeConfig) -> tuple[list[paramiko.PKey], list[paramiko.PKey]]:
    """Keys we trust for the host (known_hosts + pins) and keys known_hosts revokes."""
    trusted, revoked = _known_host_keys(cfg.known_hosts_path(), cfg.known_hosts_name)
    for line in cfg.pinned_host_keys:
        try:
            trusted.append(_parse_public_key(line))
        except ValueError as e:
            raise RunnerError(cfg.host, f"pinned host key is invalid: {e}") from None
    return trusted, revoked


def verify_host_key(cfg: SSHNodeConfig, seen: paramiko.PKey) -> None:
    """Apply ``cfg.host_key_policy`` to the key the server presented; raise HostKeyError to refuse it."""
    if cfg.host_key_policy == "skip":
        with _SKIP_LOCK:
            first = cfg.address not in _SKIP_WARNED
            _SKIP_WARNED.add(cfg.address)
        if first:
            log.warning(
                "host key checking is disabled for %s (host_key_policy='skip'): accepting %s unverified; "
                "anyone on the path can impersonate this host",
                cfg.address,
                _describe(seen),
            )
        return
    trusted, revoked = _expected_keys(cfg)
    where = f"known_hosts file {cfg.known_hosts_path()}"
    if any(_same_key(seen, k) for k in revoked):
        raise HostKeyMismatch(
            cfg.host,
            f"host key {_describe(seen)} of {cfg.address} is marked @revoked in {where}; refusing to connect. "
            "Nothing was run on this host.",
            expected=tuple(_describe(k) for k in trusted),
            seen=_describe(seen),
        )
    if any(_same_key(seen, k) for k in trusted):
        return
    if trusted:
        expected = tuple(_describe(k) for k in trusted)
        raise HostKeyMismatch(
            cfg.host,
            f"HOST KEY MISMATCH for {cfg.address}: expected {', '.join(expected)} but the server presented "
            f"{_describe(seen)}. Nothing was run on this host. If the host was re-installed or re-keyed, "
            f"update its entry {cfg.known_hosts_name!r} in the {where} (ssh-keygen -R '{cfg.known_hosts_name}' "
            "-f <file>, then add the new key) or the connection's pinned host keys; otherwise the connection "
            "may be intercepted.",
            expected=expected,
            seen=_describe(seen),
        )
    if cfg.host_key_policy == "accept-new":
        if _append_known_host(cfg, seen):
            log.info(
                "trusting new host key %s for %s (accept-new), saved to %s",
                _describe(seen),
                cfg.address,
                cfg.known_hosts_path(),
            )
            return
        verify_host_key(cfg, seen)  # somebody else recorded a key meanwhile: it must match
        return
    raise UnknownHostKey(
        cfg.host,
        f"unknown host key for {cfg.address} ({_describe(seen)}): no entry {cfg.known_hosts_name!r} in the "
        f"{where} and no pinned host key. Add the host to known_hosts (ssh-keyscan -p {cfg.port} {cfg.host}), "
        "pin its key in the connection (pinned_host_keys), or use host_key_policy='accept-new'. "
        "Nothing was run on this host.",
        seen=_describe(seen),
    )


def _load_private_key(cfg: SSHNodeConfig) -> paramiko.PKey:
    """Load the client key from text or file. Errors never carry key material."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

    source = "private_key" if cfg.private_key else f"key_file {cfg.key_file}"
    try:
        if cfg.private_key:
            data = cfg.private_key.encode()
        elif cfg.key_file:
            data = Path(cfg.key_file).expanduser().read_bytes()
        else:
            raise RunnerError(cfg.host, "no private_key or key_file configured")
        password = cfg.passphrase.encode() if cfg.passphrase else None
        try:
            loaded: Any = serialization.load_ssh_private_key(data, password=password)
        except ValueError:
            loaded = serialization.load_pem_private_key(data, password=password)
        key_class: type[paramiko.PKey]
        if isinstance(loaded, ed25519.Ed25519PrivateKey):
            key_class = paramiko.Ed25519Key
        elif isinstance(loaded, ec.EllipticCurvePrivateKey):
            key_class = paramiko.ECDSAKey
        elif isinstance(loaded, rsa.RSAPrivateKey):
            key_class = paramiko.RSAKey
        else:
            raise RunnerError(cfg.host, f"{source}: unsupported key type {type(loaded).__name__}")
        if cfg.private_key:
            return key_class.from_private_key(io.StringIO(cfg.private_key), password=cfg.passphrase)
        return paramiko.PKey.from_path(Path(cfg.key_file or "").expanduser(), password=cfg.passphrase)
    except RunnerError:
        raise
    except Exception as e:  # crypto libraries raise many types; none may leak the key
        raise RunnerError(
            cfg.host, f"cannot load {source} ({type(e).__name__}): wrong passphrase, or not a private key"
        ) from None


# --------------------------------------------------------------------------------------------- transport


def _handle_channel_request(chan: Channel, m: Message) -> None:
    """Like paramiko's, plus ``exit-signal`` (paramiko ignores it): a killed command returns -signum."""
    pos = m.packet.tell()
    if m.get_text() == "exit-signal":
        m.get_boolean()  # want_reply is always false for exit-signal
        name = m.get_text()
        number = getattr(signal, f"SIG{name}", None)
        chan.exit_status = -int(number) if number is not None else -1
        chan.status_event.set()
        return
    m.packet.seek(pos)
    Channel._handle_request(chan, m)  # type: ignore[attr-defined]


class _Transport(paramiko.Transport):
    """paramiko Transport that reports commands killed by a signal instead of a bare -1."""

    _channel_handler_table = {  # class-level dispatch table, as in paramiko
        **paramiko.Transport._channel_handler_table,  # type: ignore[attr-defined]
        MSG_CHANNEL_REQUEST: _handle_channel_request,
    }


def _tune_socket(sock: socket.socket) -> None:
    """TCP keepalive so a silently vanished node errors out instead of hanging a channel forever."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _prefer_known_key_types(t: paramiko.Transport, known: list[paramiko.PKey]) -> None:
    """Negotiate a host key type we hold a key for (as OpenSSH does), so a multi-key host can't look re-keyed."""
    names: list[str] = []
    for key in known:
        names += ["rsa-sha2-512", "rsa-sha2-256"] if key.get_name() == "ssh-rsa" else [key.get_name()]
    opts = t.get_security_options()
    current = list(opts.key_types)
    first = [n for n in dict.fromkeys(names) if n in current]
    if first:
        opts.key_types = first + [n for n in current if n not in first]


def _handshake(cfg: SSHNodeConfig, pkey: paramiko.PKey) -> tuple[paramiko.Transport, paramiko.PKey]:
    """One TCP connect + key exchange + host key check + auth, under the handshake bounds."""
    with _HOST_HANDSHAKES_LOCK:
        per_host = _HOST_HANDSHAKES.setdefault(
            (cfg.host, cfg.port), threading.BoundedSemaphore(MAX_HANDSHAKES_PER_HOST)
        )
    with per_host, _HANDSHAKES:
        sock = socket.create_connection((cfg.host, cfg.port), timeout=cfg.connect_timeout)
        t: paramiko.Transport | None = None
        try:
            _tune_socket(sock)
            t = _Transport(sock)
            t.banner_timeout = cfg.connect_timeout
            t.handshake_timeout = cfg.connect_timeout
            t.auth_timeout = cfg.connect_timeout
            if cfg.host_key_policy != "skip":
                _prefer_known_key_types(t, _expected_keys(cfg)[0])
            t.start_client(timeout=cfg.connect_timeout)
            seen = t.get_remote_server_key()  # raises SSHException if kex did not finish in time
            verify_host_key(cfg, seen)  # before auth: a wrong host never sees a session
            try:
                t.auth_publickey(cfg.user, pkey)
            except paramiko.BadAuthenticationType as e:
                raise AuthFailed(
                    cfg.host,
                    f"server {cfg.address} does not accept public-key login for user {cfg.user!r} "
                    f"(it allows: {', '.join(e.allowed_types) or 'nothing'})",
                    user=cfg.user,
                ) from None
            except paramiko.AuthenticationException:
                raise AuthFailed(
                    cfg.host,
                    f"authentication as user {cfg.user!r} on {cfg.address} failed: the server rejected the "
                    f"private key ({_describe(pkey)}). Check that its public key is in that user's "
                    "authorized_keys on the host and that the user exists.",
                    user=cfg.user,
                ) from None
            if not t.is_authenticated():
                raise AuthFailed(
                    cfg.host,
                    f"user {cfg.user!r} on {cfg.address}: server wants more than a key",
                    user=cfg.user,
                )
            t.set_keepalive(cfg.keepalive)
            return t, seen
        except BaseException:
            if t is not None:
                t.close()
            sock.close()
            raise


def _connect(cfg: SSHNodeConfig, pkey: paramiko.PKey) -> tuple[paramiko.Transport, paramiko.PKey]:
    """Handshake with bounded retries and exponential backoff; trust and auth errors are final."""
    delay = 0.2
    last: BaseException | None = None
    for attempt in range(1, cfg.connect_attempts + 1):
        try:
            return _handshake(cfg, pkey)
        except (HostKeyError, AuthFailed):
            raise
        except (OSError, EOFError, paramiko.SSHException) as e:
            last = e
            log.debug(
                "ssh connect to %s attempt %d/%d failed: %s", cfg.address, attempt, cfg.connect_attempts, e
            )
            if attempt < cfg.connect_attempts:
                time.sleep(delay)
                delay = min(delay * 2, 3.0)
    raise HostUnreachable(
        cfg.host,
        f"cannot open an SSH connection to {cfg.address} as {cfg.user!r} after {cfg.connect_attempts} "
        f"attempts: {type(last).__name__}: {last}",
    )


PoolKey = tuple[str, int, str, str]


class _Retired(Exception):
    """Internal: the pool entry was closed under a runner; it re-acquires one."""


@dataclass(eq=False)
class _PoolEntry:
    """One shared connection to a host; ``lock`` serialises (re)connects so a host gets one handshake."""

    key: PoolKey
    sessions: threading.BoundedSemaphore
    lock: threading.Lock = field(default_factory=threading.Lock)
    transport: paramiko.Transport | None = None
    host_key: paramiko.PKey | None = None
    refs: int = 0
    idle_since: float | None = None
    connects: int = 0
    #: closed by close_all() or the idle sweep: runners holding it must take a fresh entry
    retired: bool = False

    def get(self, cfg: SSHNodeConfig, pkey: paramiko.PKey) -> tuple[paramiko.Transport, paramiko.PKey]:
        """The live transport and the host key it was opened with, connecting first if needed."""
        with self.lock:
            if self.retired:
                raise _Retired
            t = self.transport
            if t is not None and t.is_active() and self.host_key is not None:
                return t, self.host_key
            if t is not None:
                log.info("ssh connection to %s dropped; reconnecting", cfg.address)
                t.close()
            self.transport = None
            t, host_key = _connect(cfg, pkey)
            self.transport, self.host_key = t, host_key
            self.connects += 1
            log.debug("ssh connected to %s as %s (connection #%d)", cfg.address, cfg.user, self.connects)
            return t, host_key

    def invalidate(self, t: paramiko.Transport) -> None:
        """Forget ``t`` if it is still the current one, so the next call reconnects."""
        with self.lock:
            if self.transport is t:
                self.transport = None
        t.close()

    def close(self) -> None:
        with self.lock:
            self.retired = True
            t, self.transport = self.transport, None
        if t is not None:
            t.close()


_POOL: dict[PoolKey, _PoolEntry] = {}
_POOL_LOCK = threading.Lock()


def _sweep_idle_locked(now: float) -> list[_PoolEntry]:
    """Drop entries nobody referenced for IDLE_TTL seconds (caller holds _POOL_LOCK, closes them)."""
    dead = [
        e
        for e in _POOL.values()
        if e.refs == 0 and e.idle_since is not None and now - e.idle_since > IDLE_TTL
    ]
    for e in dead:
        del _POOL[e.key]
    return dead


def _acquire_entry(key: PoolKey, max_sessions: int) -> _PoolEntry:
    with _POOL_LOCK:
        dead = _sweep_idle_locked(time.monotonic())
        entry = _POOL.get(key)
        if entry is None:
            entry = _POOL[key] = _PoolEntry(key=key, sessions=threading.BoundedSemaphore(max_sessions))
        entry.refs += 1
        entry.idle_since = None
    for e in dead:
        e.close()
    return entry


_SWEEPER: threading.Thread | None = None


def _sweeper() -> None:
    """Close what went idle even if no one connects again (a triggerer can sit idle for hours)."""
    global _SWEEPER
    while True:
        time.sleep(IDLE_TTL / 4)
        with _POOL_LOCK:
            dead = _sweep_idle_locked(time.monotonic())
            if not _POOL:
                _SWEEPER = None
                return
        for e in dead:
            e.close()


def _release_entry(entry: _PoolEntry) -> None:
    with _POOL_LOCK:
        entry.refs = max(0, entry.refs - 1)
        if entry.refs == 0:
            entry.idle_since = time.monotonic()
            global _SWEEPER
            if _SWEEPER is None:
                _SWEEPER = threading.Thread(target=_sweeper, name="sky-ssh-sweeper", daemon=True)
                _SWEEPER.start()


@dataclass(frozen=True)
class PoolInfo:
    """A pooled connection, for tests and diagnostics."""

    host: str
    port: int
    user: str
    active: bool
    refs: int
    connects: int


def pool_info() -> list[PoolInfo]:
    """Snapshot of the shared connections: one row per (host, port, user, client key)."""
    with _POOL_LOCK:
        entries = list(_POOL.values())
    return [
        PoolInfo(
            host=e.key[0],
            port=e.key[1],
            user=e.key[2],
            active=e.transport is not None and e.transport.is_active(),
            refs=e.refs,
            connects=e.connects,
        )
        for e in entries
    ]


def close_all() -> None:
    """Close every pooled connection (tests, process shutdown). Runners reconnect on next use."""
    with _POOL_LOCK:
        entries = list(_POOL.values())
        _POOL.clear()
    for e in entries:
        e.close()


_EXECUTOR: ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """Dedicated pool: a 64-node fan-out must not queue behind (or starve) the loop's default executor."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=EXECUTOR_THREADS, thread_name_prefix="sky-ssh")
        return _EXECUTOR


# --------------------------------------------------------------------------------------------- probing


def wait_for_ssh(
    host: str, port: int, timeout: float, *, initial: float = 0.05, max_delay: float = 1.0
) -> float:
    """Block until ``host:port`` greets with an ``SSH-`` banner; return seconds waited.

    Why a banner and not just a TCP connect: port forwards and half-started daemons accept TCP before
    sshd is able to talk. Retries back off exponentially up to ``max_delay``, bounded by ``timeout``.
    """
    start = time.monotonic()
    deadline = start + timeout
    delay = initial
    last = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5.0)) as sock:
                sock.settimeout(max(0.01, min(deadline - time.monotonic(), 5.0)))
                banner = b""
                while b"\n" not in banner and len(banner) < 1024:
                    chunk = sock.recv(256)
                    if not chunk:
                        break
                    banner += chunk
                    if banner.startswith(b"SSH-"):
                        return time.monotonic() - start
                last = f"no SSH banner (got {banner[:40]!r})"
        except OSError as e:
            last = f"{type(e).__name__}: {e}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, max_delay)
    raise HostUnreachable(host, f"no SSH server answered at {host}:{port} within {timeout:g}s (last: {last})")


# --------------------------------------------------------------------------------------------- runner


class _Wakeup(threading.Event):
    """Event shared by a channel's stdout and stderr buffers; ignores their clear() so no wakeup is lost."""

    def clear(self) -> None:
        pass

    def reset(self) -> None:
        super().clear()


#: after a timeout, seconds between SIGTERM and SIGKILL of the script's process group
KILL_GRACE = 1.0
#: how long a cancelled :meth:`SSHRunner.arun_script` waits for its thread to stop the script
ABANDON_WAIT = 2 * KILL_GRACE + 0.5


class _Abandon:
    """Set from the event loop when the caller of a call gave up; the thread running it stops.

    A cancelled ``run_in_executor`` future does not stop its thread: without this, the thread kept
    pumping a hung channel (and the remote script kept running) long after the poll moved on.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._wake: threading.Event | None = None

    def set(self) -> None:
        with self._lock:
            self._set = True
            wake = self._wake
        if wake is not None:
            wake.set()

    def wake_on_set(self, wake: threading.Event) -> None:
        """Have :meth:`set` wake ``wake`` (the channel loop's event)."""
        with self._lock:
            self._wake = wake
            if self._set:
                wake.set()

    def check(self, host: str) -> None:
        if self._set:
            raise CallAbandoned(host, "the caller gave up on this call; the script was stopped")


def _signal_channel(chan: Channel, name: str) -> None:
    """RFC 4254 ``signal`` request: sshd ``killpg``s the session (detached ``setsid`` jobs are untouched)."""
    m = Message()
    m.add_byte(bytes([MSG_CHANNEL_REQUEST]))
    m.add_int(chan.remote_chanid)
    m.add_string("signal")
    m.add_boolean(False)
    m.add_string(name)
    chan.get_transport()._send_user_message(m)  # type: ignore[attr-defined]


def _stop_remote(chan: Channel) -> None:
    """A timed-out script must not keep running: TERM, a short grace, then KILL (best effort)."""
    with contextlib.suppress(Exception):
        _signal_channel(chan, "TERM")
        if not chan.status_event.wait(KILL_GRACE):
            _signal_channel(chan, "KILL")
            chan.status_event.wait(KILL_GRACE)


def _consume(fut: asyncio.Future[Any]) -> None:
    """Retrieve the outcome of a call nobody awaits any more (no "exception never retrieved")."""
    if not fut.cancelled():
        fut.exception()


@contextlib.contextmanager
def _slot(sessions: threading.BoundedSemaphore, host: str, abandon: _Abandon | None) -> Iterator[None]:
    """Hold one of a connection's session slots; a call given up on stops waiting for one."""
    if abandon is None:
        sessions.acquire()
    else:
        while not sessions.acquire(timeout=0.1):
            abandon.check(host)
    try:
        yield
    finally:
        sessions.release()


class SSHRunner(CommandRunner):
    """Runs ``sh -s -- ARGS`` on one node over a pooled SSH connection, script on stdin."""

    def __init__(self, config: SSHNodeConfig) -> None:
        self.config = config
        self.host = config.host
        self._lock = threading.Lock()
        self._pkey: paramiko.PKey | None = None
        self._entry: _PoolEntry | None = None
        self._verified: paramiko.Transport | None = None

    def __repr__(self) -> str:
        return f"SSHRunner({self.config.user}@{self.config.address})"

    # -- connection

    def _key(self) -> paramiko.PKey:
        with self._lock:
            if self._pkey is None:
                self._pkey = _load_private_key(self.config)
            return self._pkey

    def _pool_entry(self) -> _PoolEntry:
        pkey = self._key()
        with self._lock:
            if self._entry is None:
                cfg = self.config
                self._entry = _acquire_entry(
                    (cfg.host, cfg.port, cfg.user, pkey.fingerprint), cfg.max_sessions
                )
            return self._entry

    def _transport(self) -> tuple[_PoolEntry, paramiko.Transport]:
        """The shared transport, (re)connected if needed and checked against *this* runner's trust policy."""
        while True:
            entry = self._pool_entry()
            try:
                t, host_key = entry.get(self.config, self._key())
                break
            except _Retired:  # close_all() ran: rejoin the pool rather than keep a private connection
                with self._lock:
                    if self._entry is entry:
                        self._entry = None
                        self._verified = None
        if self._verified is not t:
            verify_host_key(self.config, host_key)
            self._verified = t
        return entry, t

    @contextlib.contextmanager
    def _session(
        self, open_fn: Callable[[paramiko.Transport], Any], abandon: _Abandon | None = None
    ) -> Iterator[Any]:
        """Yield ``open_fn(transport)``; a stale transport is replaced once (opening a channel runs nothing).

        ``abandon``: a call given up on while it waits for a free session slot leaves the queue.
        """
        entry, t = self._transport()
        with _slot(entry.sessions, self.host, abandon):
            try:
                chan = open_fn(t)
            except paramiko.ChannelException as e:
                raise RunnerError(
                    self.host,
                    f"{self.config.address} refused a new session ({e.text}); if sshd's MaxSessions is "
                    "below max_sessions, lower max_sessions",
                ) from None
            except (paramiko.SSHException, EOFError, OSError) as e:
                log.info("ssh session to %s failed (%s); reconnecting once", self.config.address, e)
                entry.invalidate(t)
                entry, t = self._transport()
                try:
                    chan = open_fn(t)
                except (paramiko.SSHException, EOFError, OSError) as e2:
                    entry.invalidate(t)
                    raise RunnerError(
                        self.host, f"cannot open an SSH session on {self.config.address}: {e2}"
                    ) from e2
            try:
                yield chan
            finally:
                chan.close()

    def close(self) -> None:
        """Drop this runner's reference to the shared connection (closed once idle for IDLE_TTL)."""
        with self._lock:
            entry, self._entry = self._entry, None
            self._verified = None
        if entry is not None:
            _release_entry(entry)

    # -- commands

    def run_script(
        self,
        script: str,
        args: list[str] | None = None,
        timeout: float | None = None,
        *,
        abandon: _Abandon | None = None,
    ) -> RunResult:
        """Run the script, blocking; ``abandon`` (set by :meth:`arun_script` when it is cancelled)
        stops it early: the remote script is signalled and the channel closed."""
        if abandon is not None:
            abandon.check(self.host)  # given up on while it queued for a thread
        CALLS.add(self.host)
        command = " ".join(["sh", "-s", "--", *(shlex.quote(a) for a in args or [])])
        cfg = self.config
        with self._session(lambda t: t.open_session(timeout=cfg.connect_timeout), abandon) as chan:
            if abandon is not None:
                abandon.check(self.host)  # given up on while connecting: nothing started
            try:
                chan.exec_command(command)
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise RunnerError(self.host, f"cannot start the script on {cfg.address}: {e}") from e
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                stdout, stderr = self._pump(chan, script.encode(), deadline, timeout, abandon)
            except (CommandTimeout, CallAbandoned):
                _stop_remote(chan)
                raise
            status = chan.exit_status
            if status == -1 and not chan.get_transport().is_active():
                raise RunnerError(self.host, f"connection to {cfg.address} was lost while the script ran")
            if status == -1:
                raise RunnerError(self.host, f"{cfg.address} closed the session without an exit status")
            return RunResult(status, stdout, stderr)

    def _pump(
        self,
        chan: Channel,
        stdin: bytes,
        deadline: float | None,
        timeout: float | None,
        abandon: _Abandon | None = None,
    ) -> tuple[bytes, bytes]:
        """Feed stdin and drain stdout and stderr together, so neither side's flow-control window can wedge.

        Raises :class:`CallAbandoned` as soon as ``abandon`` is set (the caller stops the script).
        """
        wake = _Wakeup()
        chan.in_buffer.set_event(wake)
        chan.in_stderr_buffer.set_event(wake)
        if abandon is not None:
            abandon.wake_on_set(wake)
        out: list[bytes] = []
        err: list[bytes] = []
        sent = 0
        stdin_open = True

        def remaining() -> float | None:
            if deadline is None:
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommandTimeout(
                    self.host, f"script on {self.config.address} still running after {timeout:g}s"
                )
            return left

        while True:
            wake.reset()
            if stdin_open:
                try:
                    while sent < len(stdin) and chan.send_ready():
                        n = chan.send(stdin[sent : sent + 32768])
                        if n <= 0:
                            break
                        sent += n
                    if sent >= len(stdin) or chan.closed or chan.eof_received:
                        chan.shutdown_write()
                        stdin_open = False
                except OSError:  # remote stopped reading stdin (exited early): not our error
                    stdin_open = False
            finished = chan.eof_received or chan.closed
            while chan.recv_ready():
                out.append(chan.recv(_CHUNK))
            while chan.recv_stderr_ready():
                err.append(chan.recv_stderr(_CHUNK))
            if finished:
                break
            if abandon is not None:
                abandon.check(self.host)
            left = remaining()
            if stdin_open:  # window adjustments do not wake us; poll while stdin is waiting for window
                left = 0.05 if left is None else min(left, 0.05)
            wake.wait(left)
        while not chan.status_event.wait(min(remaining() or 1.0, 1.0)):
            if abandon is not None:
                abandon.check(self.host)
        return b"".join(out), b"".join(err)

    async def aconnect(self) -> None:
        """Establish (or reuse) the pooled transport; errors are left for the call that follows."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await loop.run_in_executor(_executor(), self._transport)

    async def arun_script(
        self, script: str, args: list[str] | None = None, timeout: float | None = None
    ) -> RunResult:
        """:meth:`run_script` in the runner's thread pool, ``timeout`` as there.

        Cancelling it stops the call: its thread signals the remote script (TERM, then KILL after
        :data:`KILL_GRACE`) and closes the channel; the cancel waits for that, at most
        :data:`ABANDON_WAIT`, so a poll that gave up on a node leaves no thread pumping its channel.
        """
        loop = asyncio.get_running_loop()
        abandon = _Abandon()
        fut = loop.run_in_executor(
            _executor(), functools.partial(self.run_script, script, args, timeout, abandon=abandon)
        )
        fut.add_done_callback(_consume)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            abandon.set()
            await asyncio.wait([fut], timeout=ABANDON_WAIT)
            raise

    # -- files

    @staticmethod
    def _remote(sftp: paramiko.SFTPClient, path: str) -> str:
        """``~`` / ``~/x`` -> the remote home; SFTP sessions start there, so resolve it once."""
        if path == "~" or path.startswith("~/"):
            home = sftp.normalize(".")
            rest = path[2:].lstrip("/")
            return f"{home.rstrip('/')}/{rest}" if rest else home
        return path

    def _makedirs(self, sftp: paramiko.SFTPClient, path: str) -> None:
        parts = [p for p in path.split("/") if p]
        current = "/" if path.startswith("/") else ""
        for part in parts:
            current = f"{current}{part}" if current in ("", "/") else f"{current}/{part}"
            try:
                if not stat.S_ISDIR(sftp.stat(current).st_mode or 0):
                    raise RunnerError(self.host, f"remote {current} exists and is not a directory")
            except FileNotFoundError:
                try:
                    sftp.mkdir(current)
                except OSError:
                    if not stat.S_ISDIR(
                        sftp.stat(current).st_mode or 0
                    ):  # lost a race: fine if it is a dir now
                        raise

    def _put(self, sftp: paramiko.SFTPClient, local: Path, remote: str, mode: int | None) -> None:
        st = local.stat()  # follows symlinks: we copy the target's content
        with open(local, "rb") as fh:
            sftp.putfo(fh, remote, file_size=st.st_size)
        sftp.chmod(remote, mode if mode is not None else stat.S_IMODE(st.st_mode))

    def _sftp(self) -> contextlib.AbstractContextManager[paramiko.SFTPClient]:
        def open_sftp(t: paramiko.Transport) -> paramiko.SFTPClient:
            client = paramiko.SFTPClient.from_transport(t)
            if client is None:
                raise paramiko.SSHException("sftp subsystem unavailable")
            return client

        return self._session(open_sftp)

    def put_file(self, local: str | os.PathLike[str], remote: str, mode: int | None = None) -> None:
        """Upload one file (parents created); keeps its permission bits unless ``mode`` is given."""
        CALLS.add(self.host)
        src = Path(local)
        try:
            with self._sftp() as sftp:
                dest = self._remote(sftp, remote)
                parent = dest.rsplit("/", 1)[0] if "/" in dest.rstrip("/") else ""
                if parent:
                    self._makedirs(sftp, parent)
                self._put(sftp, src, dest, mode)
        except OSError as e:
            raise RunnerError(
                self.host, f"upload of {src} to {self.config.address}:{remote} failed: {e}"
            ) from e
        log.debug("uploaded %s to %s:%s", src, self.config.address, remote)

    def _copy_dir(
        self, sftp: paramiko.SFTPClient, local: Path, remote: str, ancestors: frozenset[tuple[int, int]]
    ) -> int:
        """Copy ``local``'s entries into the existing remote dir ``remote``, following symlinks."""
        st = local.stat()
        ancestors = ancestors | {(st.st_dev, st.st_ino)}
        count = 0
        for entry in sorted(os.scandir(local), key=lambda e: e.name):
            path = Path(entry.path)
            dest = f"{remote.rstrip('/')}/{entry.name}"
            if not path.exists():
                raise FileNotFoundError(f"broken symlink {path} -> {os.readlink(path)}")
            if path.is_dir():
                sub = path.stat()
                if (sub.st_dev, sub.st_ino) in ancestors:
                    log.warning("skipping %s: symlink loop back to one of its parents", path)
                    continue
                try:
                    sftp.mkdir(dest)
                except OSError:
                    if not stat.S_ISDIR(sftp.stat(dest).st_mode or 0):
                        raise
                count += self._copy_dir(sftp, path, dest, ancestors)
            elif path.is_file():
                self._put(sftp, path, dest, None)
                count += 1
            else:
                log.warning("skipping %s: not a regular file or directory", path)
        return count

    def put_tree(self, local_path: str | os.PathLike[str], remote_path: str) -> int:
        """Copy a directory's contents into ``remote_path`` (like ``rsync -rL src/ dest/``); return files sent.

        Symlinks are followed (a link to a directory is copied as a directory, loops are skipped) and
        permission bits, including the executable bit, are kept.
        """
        src = Path(local_path)
        if not src.is_dir():
            self.put_file(src, remote_path)
            return 1
        CALLS.add(self.host)
        try:
            with self._sftp() as sftp:
                root = self._remote(sftp, remote_path)
                self._makedirs(sftp, root)
                count = self._copy_dir(sftp, src, root, frozenset())
        except OSError as e:
            raise RunnerError(
                self.host, f"copy of {src} to {self.config.address}:{remote_path} failed: {e}"
            ) from e
        log.debug("copied %d files from %s to %s:%s", count, src, self.config.address, remote_path)
        return count
