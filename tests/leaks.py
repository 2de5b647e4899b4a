"""Find processes a test left behind, by what they touch: their command line or working directory."""

from __future__ import annotations

import os
from pathlib import Path


def processes_under(path: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """Live (non-zombie) processes whose cwd is inside ``path`` or whose command line names it."""
    root = str(Path(path).resolve())
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace").strip()
            try:
                cwd = os.readlink(entry / "cwd")
            except OSError:
                cwd = ""
        except (OSError, IndexError):
            continue
        if root in cmd or cwd == root or cwd.startswith(root + "/"):
            found.append((int(entry.name), cmd or cwd))
    return found
