"""Find processes a test left behind, by what they touch: their command line or working directory.

The scan itself lives in the package's dev tools (the demo uses it too); tests import it from here.
A launch-side watcher (``python -m airflow_provider_sky.watch.bridge``) runs in ``/`` with no path of the
state dir on its command line, so :func:`processes_under` cannot see it: :func:`bridges` finds it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

from airflow_provider_sky.watch.bridge import MODULE
from devstack.stack import processes_under

__all__ = ["bridges", "job_processes", "live_processes", "processes_under"]


def job_processes(state_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """:func:`processes_under` without the local backend's background delete of a torn-down cluster's
    tree (``backends.local.trash``): no process of a job, and it ends by itself (the autouse check in
    ``conftest`` still waits for it, and fails a test it outlives by 120 s)."""
    trash = f"{state_dir}/local/.trash/"
    # the remover is seen as ``rm`` or, between its shell's fork and the exec, as that shell
    remover = ("rm -rf -- ", 'sh -c rm -rf -- "$@" ')
    return [
        (pid, cmd)
        for pid, cmd in processes_under(state_dir)
        if not (cmd.startswith(remover) and trash in cmd)
    ]


def live_processes() -> Iterator[tuple[Path, list[str]]]:
    """Every live (non-zombie) process: its /proc entry and the fields of its ``stat`` after the
    command name (``[0]`` state, ``[1]`` ppid, ``[2]`` pgid). Processes that vanish are skipped."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] not in ("Z", "X"):
            yield entry, fields


def bridges(state_dir: str | os.PathLike[str] | None = None) -> list[tuple[int, str]]:
    """Live bridge processes; with ``state_dir``, those whose ``SKY_PROVIDER_HOME`` is that directory.

    Every test's leak check scans /proc with this: the command line is read first, the rest only for
    a bridge's."""
    want = f"SKY_PROVIDER_HOME={state_dir}".encode() if state_dir is not None else b""
    module = MODULE.encode()
    me = str(os.getpid())
    found: list[tuple[int, int, str]] = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == me:
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
            if module not in cmd:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().rsplit(b")", 1)[1].split()
            if stat[0] in (b"Z", b"X"):
                continue
            if want:
                with open(f"/proc/{name}/environ", "rb") as f:
                    if want not in f.read().split(b"\0"):
                        continue
        except (OSError, IndexError):
            continue
        found.append((int(name), int(stat[1]), b" ".join(cmd).decode("utf-8", "replace").strip()))
    # a bridge's child between fork and exec still shows the bridge's command line: not a bridge
    pids = {pid for pid, _, _ in found}
    return [(pid, cmd) for pid, ppid, cmd in found if ppid not in pids]
