"""The process-wide SSH connection pool: one authenticated transport per (host, port, user, client key).

Why a pool: a gang of N nodes is polled by many triggers and launched by a parallel fan-out; a fresh SSH
handshake per call would cost O(calls) handshakes and trip sshd's ``MaxStartups``. So each transport is
kept open and multiplexed (one channel per call). Runners take a reference to an entry; an entry nobody
references is closed after :data:`IDLE_TTL` seconds, by the next acquire or by a sweeper thread.
Blocking calls of :meth:`SSHRunner.arun_script` run on this module's thread pool (:func:`executor`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import paramiko

from airflow_provider_sky.runners.ssh.config import SSHNodeConfig
from airflow_provider_sky.runners.ssh.transport import connect

log = logging.getLogger(__name__)

#: threads for :meth:`SSHRunner.arun_script`; sized for a wide gang fan-out, not the CPU count
EXECUTOR_THREADS = 128

#: an unreferenced pooled transport is closed after this many idle seconds (triggers re-create runners)
IDLE_TTL = 60.0


PoolKey = tuple[str, int, str, str]


class Retired(Exception):
    """Internal: the pool entry was closed under a runner; it re-acquires one."""


@dataclass(eq=False)
class PoolEntry:
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
                raise Retired
            t = self.transport
            if t is not None and t.is_active() and self.host_key is not None:
                return t, self.host_key
            if t is not None:
                log.info("ssh connection to %s dropped; reconnecting", cfg.address)
                t.close()
            self.transport = None
            t, host_key = connect(cfg, pkey)
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


_POOL: dict[PoolKey, PoolEntry] = {}
_POOL_LOCK = threading.Lock()


def _sweep_idle_locked(now: float) -> list[PoolEntry]:
    """Drop entries nobody referenced for IDLE_TTL seconds (caller holds _POOL_LOCK, closes them)."""
    dead = [
        e
        for e in _POOL.values()
        if e.refs == 0 and e.idle_since is not None and now - e.idle_since > IDLE_TTL
    ]
    for e in dead:
        del _POOL[e.key]
    return dead


def acquire_entry(key: PoolKey, max_sessions: int) -> PoolEntry:
    with _POOL_LOCK:
        dead = _sweep_idle_locked(time.monotonic())
        entry = _POOL.get(key)
        if entry is None:
            entry = _POOL[key] = PoolEntry(key=key, sessions=threading.BoundedSemaphore(max_sessions))
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
            last = not _POOL
            if last:
                _SWEEPER = None
        # closed also when they were the last: dropped from the pool, nothing else would close them
        for e in dead:
            e.close()
        if last:
            return


def release_entry(entry: PoolEntry) -> None:
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


def executor() -> ThreadPoolExecutor:
    """Dedicated pool: a 64-node fan-out must not queue behind (or starve) the loop's default executor."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(max_workers=EXECUTOR_THREADS, thread_name_prefix="sky-ssh")
        return _EXECUTOR
