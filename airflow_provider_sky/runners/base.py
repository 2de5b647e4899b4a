"""The one thing every backend hands out: a way to run a shell script on one node.

Runners know nothing of what the script does. The node runtime (``runtime.py``) sends its POSIX ``sh``
scripts on *stdin* (``sh -s -- ARGS``) so user data (commands, env values, secrets) never appears on a
command line, where ``ps`` would show it.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field


class RunnerError(Exception):
    """A node could not be reached or the transport failed (not: the command exited nonzero)."""

    def __init__(self, host: str, message: str) -> None:
        super().__init__(f"{host}: {message}")
        self.host = host


@dataclass(frozen=True)
class RunResult:
    """What a script run on a node returned."""

    returncode: int
    stdout: bytes
    stderr: bytes

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", "replace")

    @property
    def error_text(self) -> str:
        return self.stderr.decode("utf-8", "replace").strip()


@dataclass
class CallCounter:
    """Counts remote calls per host, so benchmarks and tests can prove monitoring cost is O(N)."""

    counts: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, host: str) -> None:
        with self._lock:
            self.counts[host] += 1

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()


CALLS = CallCounter()


class CommandRunner(ABC):
    """Runs ``sh -s -- *args`` on one node with ``script`` fed on stdin."""

    #: address shown to users and used as the node's IP in rank env vars
    host: str

    @abstractmethod
    def run_script(
        self, script: str, args: list[str] | None = None, timeout: float | None = None
    ) -> RunResult:
        """Run ``script`` with POSIX ``sh`` on the node, blocking. Raise RunnerError on transport failure."""

    @abstractmethod
    async def arun_script(
        self, script: str, args: list[str] | None = None, timeout: float | None = None
    ) -> RunResult:
        """Same as :meth:`run_script` without blocking the event loop."""

    async def aconnect(self) -> None:  # noqa: B027 - optional hook, most runners hold nothing
        """Open the connection ahead of a call, so the call itself goes out at once (a gang start
        decides at the last moment whether a rank still starts)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most runners hold nothing
        """Release connections; the runner may be used again afterwards (it reconnects)."""
