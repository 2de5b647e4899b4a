"""A local port relayed over SSH to a port on the node: how a control plane outside a cloud network (an
EC2 cluster's security group) reaches the head's node agent through the SSH access it has anyway.

Each connection to the local port (127.0.0.1, a free port) gets an SSH exec channel on the pooled
connection that runs a few lines of ``python3`` on the node, copying bytes between the channel and the
node's ``127.0.0.1:PORT``. No port forwarding is needed from sshd (``AllowTcpForwarding`` may be off), and
the bytes are the agent's protocol, authenticated and encrypted end to end by the cluster's token.
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import socket
import threading
from typing import Any

from airflow_provider_sky.runners.ssh.runner import SSHRunner

log = logging.getLogger(__name__)

#: relayed connections at once: each holds one of the host connection's SSH sessions (sshd allows
#: ``MaxSessions``, 10 by default, and the runner as many), so local clients that open many and say
#: nothing (the head drops them after its 5 s handshake) never take the sessions the control plane's
#: other calls to that host need
MAX_RELAYED = 4
#: seconds a connection past them waits for one to end before it is closed
RELAY_WAIT = 10.0

#: the node's side: stdin -> 127.0.0.1:PORT -> stdout, until either side closes
_NODE_SIDE = """import os, socket, sys, threading
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
s.settimeout(None)
def up():
    while True:
        b = os.read(0, 65536)
        if not b:
            break
        s.sendall(b)
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
threading.Thread(target=up, daemon=True).start()
out = sys.stdout.buffer
while True:
    b = s.recv(65536)
    if not b:
        break
    out.write(b)
    out.flush()
"""


class Relay:
    """``127.0.0.1:<port>`` here, relayed to ``127.0.0.1:<node_port>`` on the runner's node."""

    def __init__(self, runner: SSHRunner, node_port: int) -> None:
        self.runner = runner
        self.node_port = node_port
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._closed = threading.Event()
        self._slots = threading.BoundedSemaphore(min(MAX_RELAYED, max(1, runner.config.max_sessions // 2)))
        threading.Thread(target=self._accept, daemon=True, name=f"ssh-relay-{self.port}").start()

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        command = f"python3 -c {shlex.quote(_NODE_SIDE)} {int(self.node_port)}"
        if not self._slots.acquire(timeout=RELAY_WAIT):
            log.info(
                "relay to %s port %s: %d connections relayed already",
                self.runner.host,
                self.node_port,
                MAX_RELAYED,
            )
            conn.close()
            return
        try:
            if self._closed.is_set():  # waited for a slot past close(): the runner is its owner's no more
                conn.close()
                return
            with conn, self.runner.stream(command) as chan:
                down = threading.Thread(target=_copy_down, args=(chan, conn), daemon=True)
                down.start()
                while True:
                    data = conn.recv(65536)
                    if not data:
                        break
                    chan.sendall(data)
                with contextlib.suppress(Exception):
                    chan.shutdown_write()
                down.join()
        except Exception as exc:  # the client sees its connection closed and says so
            log.info("relay to %s port %s: %s", self.runner.host, self.node_port, exc)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.close()


def _copy_down(chan: Any, conn: socket.socket) -> None:
    try:
        while True:
            data = chan.recv(65536)
            if not data:
                break
            conn.sendall(data)
    except OSError:
        pass
    finally:
        # both ways: the node's side closed (the agent dropped the connection), so the relay's read of
        # a client that says nothing ends too, and its session is freed
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
