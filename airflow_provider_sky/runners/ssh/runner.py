"""SSHRunner: run ``sh -s -- ARGS`` on a node over a session of the pooled connection, script on stdin.

A call holds one of the connection's session slots, feeds the script and drains stdout and stderr
together (:meth:`SSHRunner._pump`). A call that times out, or whose async caller gives up, signals the
remote script (TERM, then KILL) and closes its channel, so nothing keeps running for a call nobody waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paramiko
from paramiko.channel import Channel
from paramiko.common import MSG_CHANNEL_REQUEST
from paramiko.message import Message

from airflow_provider_sky.runners.base import CALLS, CommandRunner, RunnerError, RunResult
from airflow_provider_sky.runners.ssh import sftp
from airflow_provider_sky.runners.ssh.config import SSHNodeConfig
from airflow_provider_sky.runners.ssh.errors import CallAbandoned, CommandTimeout
from airflow_provider_sky.runners.ssh.hostkeys import verify_host_key
from airflow_provider_sky.runners.ssh.keys import load_private_key
from airflow_provider_sky.runners.ssh.pool import PoolEntry, Retired, acquire_entry, executor, release_entry

log = logging.getLogger(__name__)

_CHUNK = 65536


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
        self._entry: PoolEntry | None = None
        self._verified: paramiko.Transport | None = None
        #: close() ran: a call still made (a thread the runner's owner left, e.g. an abandoned call or a
        #: relay's waiting client) takes a reference to the pooled connection and gives it back as it ends
        self._closed = False

    def __repr__(self) -> str:
        return f"SSHRunner({self.config.user}@{self.config.address})"

    # -- connection

    def _key(self) -> paramiko.PKey:
        with self._lock:
            if self._pkey is None:
                self._pkey = load_private_key(self.config)
            return self._pkey

    def _pool_entry(self) -> PoolEntry:
        pkey = self._key()
        with self._lock:
            if self._entry is None:
                cfg = self.config
                self._entry = acquire_entry(
                    (cfg.host, cfg.port, cfg.user, pkey.fingerprint), cfg.max_sessions
                )
            return self._entry

    def _transport(self) -> tuple[PoolEntry, paramiko.Transport]:
        """The shared transport, (re)connected if needed and checked against *this* runner's trust policy."""
        while True:
            entry = self._pool_entry()
            try:
                t, host_key = entry.get(self.config, self._key())
                break
            except Retired:  # close_all() ran: rejoin the pool rather than keep a private connection
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
        with self._call():
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

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        """A call; on a runner closed before or meanwhile, the reference it took is given back at its
        end: nothing else would, and the pool would keep the connection open for the process's life."""
        try:
            yield
        finally:
            if self._closed:
                self.close()

    def close(self) -> None:
        """Drop this runner's reference to the shared connection (closed once idle for IDLE_TTL)."""
        with self._lock:
            self._closed = True
            entry, self._entry = self._entry, None
            self._verified = None
        if entry is not None:
            release_entry(entry)

    # -- commands

    @contextlib.contextmanager
    def stream(self, command: str) -> Iterator[Channel]:
        """A long-lived exec channel running ``command`` (a relay's node side): its stdin and stdout are
        the caller's to use; it holds one of the host's session slots until closed."""
        cfg = self.config
        with self._session(lambda t: t.open_session(timeout=cfg.connect_timeout)) as chan:
            try:
                chan.exec_command(command)
            except (paramiko.SSHException, EOFError, OSError) as e:
                raise RunnerError(self.host, f"cannot start a command on {cfg.address}: {e}") from e
            yield chan

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

    def connect(self) -> None:
        """Open (or reuse) the pooled connection: handshake, host-key check, authentication; nothing is
        run. Raises what a call would (``HostKeyMismatch``, ``AuthFailed``, ``HostUnreachable``)."""
        with self._call():
            self._transport()

    async def aconnect(self) -> None:
        """Establish (or reuse) the pooled transport; errors are left for the call that follows."""
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await loop.run_in_executor(executor(), self.connect)

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
            executor(), functools.partial(self.run_script, script, args, timeout, abandon=abandon)
        )
        fut.add_done_callback(_consume)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            abandon.set()
            await asyncio.wait([fut], timeout=ABANDON_WAIT)
            raise

    # -- files

    def put_file(self, local: str | os.PathLike[str], remote: str, mode: int | None = None) -> None:
        """Upload one file over SFTP (parents created); keeps its permission bits unless ``mode`` is given."""
        CALLS.add(self.host)
        src = Path(local)
        try:
            with self._session(sftp.open_client) as client:
                sftp.put_file(client, src, remote, mode, self.host)
        except OSError as e:
            raise RunnerError(
                self.host, f"upload of {src} to {self.config.address}:{remote} failed: {e}"
            ) from e
        log.debug("uploaded %s to %s:%s", src, self.config.address, remote)

    def put_tree(self, local_path: str | os.PathLike[str], remote_path: str) -> int:
        """Copy a directory's contents into ``remote_path`` over SFTP (like ``rsync -rL src/ dest/``);
        return files sent. Entries as :func:`~airflow_provider_sky.runners.base.walk_tree` gives them:
        symlinks followed, loops skipped, permission bits (the executable bit included) kept.
        """
        src = Path(local_path)
        if not src.is_dir():
            self.put_file(src, remote_path)
            return 1
        CALLS.add(self.host)
        try:
            with self._session(sftp.open_client) as client:
                count = sftp.put_tree(client, src, remote_path, self.host)
        except OSError as e:
            raise RunnerError(
                self.host, f"copy of {src} to {self.config.address}:{remote_path} failed: {e}"
            ) from e
        log.debug("copied %d files from %s to %s:%s", count, src, self.config.address, remote_path)
        return count
