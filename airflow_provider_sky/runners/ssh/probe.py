"""Wait for a node's sshd to come up, by its banner, without logging in."""

from __future__ import annotations

import socket
import time

from airflow_provider_sky.runners.ssh.errors import HostUnreachable


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
