"""When the last process of a gang was seen alive, read from /proc (fail-fast latency in tests).

A rank's ``sleep 10000`` carries the rank's environment (``SKYPILOT_TASK_ID``, the user's ``envs``, the
runtime's ``SKY_PROVIDER_MARK=<rank dir>/``), so a test finds a gang's processes by a piece of it,
before knowing the job id if need be. Tests run as root (the SSH hosts' users are others), so every
process's environment is readable.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path


def matching(marker: str, argv: tuple[str, ...] = ("sleep", "10000")) -> list[int]:
    """Live processes running exactly ``argv`` whose environment contains ``marker``."""
    want = b"\0".join(a.encode() for a in argv) + b"\0"
    mark = marker.encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if fh.read() != want:
                    continue
            with open(f"/proc/{name}/environ", "rb") as fh:
                if mark not in fh.read():
                    continue
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("Z", "X"):
            found.append(int(name))
    return found


class LastAlive(threading.Thread):
    """Scan every ``tick`` seconds; ``last_alive``: the wall time of the last scan that found one.

    ``seen`` counts the distinct pids found; 0 means none was ever seen (gone before its first scan).
    """

    def __init__(self, marker: str, argv: tuple[str, ...] = ("sleep", "10000"), tick: float = 0.02) -> None:
        super().__init__(daemon=True, name=f"last-alive-{marker[:20]}")
        self.marker = marker
        self.argv = argv
        self.tick = tick
        self.last_alive: float | None = None
        self.seen: set[int] = set()
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            now = time.time()
            pids = matching(self.marker, self.argv)
            if pids:
                self.last_alive = now
                self.seen.update(pids)
            self._halt.wait(self.tick)

    def __enter__(self) -> LastAlive:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self.join(5)
