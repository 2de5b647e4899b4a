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
    """Live bridge processes; with ``state_dir``, those whose ``SKY_PROVIDER_HOME`` is that directory."""
    want = f"SKY_PROVIDER_HOME={state_dir}".encode() if state_dir is not None else b""
    found: list[tuple[int, int, str]] = []
    for entry, stat in live_processes():
        if int(entry.name) == os.getpid():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if MODULE.encode() not in cmd:
                continue
            if want and want not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        found.append((int(entry.name), int(stat[1]), b" ".join(cmd).decode("utf-8", "replace").strip()))
    # a bridge's child between fork and exec still shows the bridge's command line: not a bridge
    pids = {pid for pid, _, _ in found}
    return [(pid, cmd) for pid, ppid, cmd in found if ppid not in pids]
