"""Open one authenticated SSH connection: TCP connect, key exchange, host-key check, public-key login.

Handshakes are bounded process-wide and per sshd: sshd's ``MaxStartups`` (10:30:100) drops
unauthenticated connections at random once ten are in flight, so a wide gang fan-out must not open
them all at once. Trust and auth errors are final; network errors are retried with backoff.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

import paramiko
from paramiko.channel import Channel
from paramiko.common import MSG_CHANNEL_REQUEST
from paramiko.message import Message

from airflow_provider_sky.runners.ssh.config import SSHNodeConfig
from airflow_provider_sky.runners.ssh.errors import AuthFailed, HostKeyError, HostUnreachable
from airflow_provider_sky.runners.ssh.hostkeys import describe, expected_keys, verify_host_key

log = logging.getLogger(__name__)

#: process-wide bound on SSH handshakes in flight (client CPU, and fan-out through one jump host)
MAX_CONCURRENT_HANDSHAKES = 8
_HANDSHAKES = threading.BoundedSemaphore(MAX_CONCURRENT_HANDSHAKES)
#: per-sshd bound: sshd's ``MaxStartups 10:30:100`` starts dropping at 10 unauthenticated connections and
#: learns of a finished login a little after the client does, so stay well below 10 (retries cover the rest,
#: e.g. other processes connecting to the same host)
MAX_HANDSHAKES_PER_HOST = 4
_HOST_HANDSHAKES: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_HOST_HANDSHAKES_LOCK = threading.Lock()


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
                _prefer_known_key_types(t, expected_keys(cfg)[0])
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
                    f"private key ({describe(pkey)}). Check that its public key is in that user's "
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


def connect(cfg: SSHNodeConfig, pkey: paramiko.PKey) -> tuple[paramiko.Transport, paramiko.PKey]:
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
