"""Find processes a test left behind, by what they touch: their command line or working directory.

The scan itself lives in the package's dev tools (the demo uses it too); tests import it from here.
A launch-side watcher (``python -m airflow_provider_sky.bridge``) runs in ``/`` with no path of the
state dir on its command line, so :func:`processes_under` cannot see it: :func:`bridges` finds it.
"""

from __future__ import annotations

import os
from pathlib import Path

from airflow_provider_sky.bridge import MODULE
from airflow_provider_sky.dev.stack import processes_under

__all__ = ["bridges", "processes_under"]


def bridges(state_dir: str | os.PathLike[str] | None = None) -> list[tuple[int, str]]:
    """Live bridge processes; with ``state_dir``, those whose ``SKY_PROVIDER_HOME`` is that directory."""
    want = f"SKY_PROVIDER_HOME={state_dir}".encode() if state_dir is not None else b""
    found: list[tuple[int, int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if stat[0] in ("Z", "X"):
                continue
            ppid = int(stat[1])
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if MODULE.encode() not in cmd:
                continue
            if want and want not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except (OSError, IndexError, ValueError):
            continue
        found.append((int(entry.name), ppid, b" ".join(cmd).decode("utf-8", "replace").strip()))
    # a bridge's child between fork and exec still shows the bridge's command line: not a bridge
    pids = {pid for pid, _, _ in found}
    return [(pid, cmd) for pid, ppid, cmd in found if ppid not in pids]
