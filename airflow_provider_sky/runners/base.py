"""The one thing every backend hands out: a way to run a shell script on one node, and copy files to it.

Runners know nothing of what the script does. The node runtime (``runtime.py``) sends its POSIX ``sh``
scripts on *stdin* (``sh -s -- ARGS``) so user data (commands, env values, secrets) never appears on a
command line, where ``ps`` would show it.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from airflow_provider_sky.errors import RunnerError as RunnerError

log = logging.getLogger(__name__)


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

    @abstractmethod
    def put_file(self, local: str | os.PathLike[str], remote: str, mode: int | None = None) -> None:
        """Copy the local file ``local`` to ``remote`` on the node, creating missing parent directories.

        ``remote``: ``~``, ``~/x`` and relative paths are under the node's home. A symlink ``local`` is
        followed (its target's content is copied). The file keeps its permission bits (the executable bit
        included) unless ``mode`` is given. Raise RunnerError if the copy fails.
        """

    @abstractmethod
    def put_tree(self, local_path: str | os.PathLike[str], remote_path: str) -> int:
        """Copy a directory's contents into ``remote_path`` (like ``rsync -rL src/ dest/``); return files sent.

        Paths as in :meth:`put_file`; existing files are overwritten, others left alone. Entries are as
        :func:`walk_tree` gives them: symlinks followed (a link to a directory arrives as a directory, a
        link back to a parent is skipped), a broken symlink is an error, permission bits are kept. A
        ``local_path`` that is not a directory is copied like :meth:`put_file` (and counts 1).
        """

    async def aconnect(self) -> None:  # noqa: B027 - optional hook, most runners hold nothing
        """Open the connection ahead of a call, so the call itself goes out at once (a gang start
        decides at the last moment whether a rank still starts)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most runners hold nothing
        """Release connections; the runner may be used again afterwards (it reconnects)."""


@dataclass(frozen=True)
class TreeEntry:
    """One entry of a local tree to copy (see :func:`walk_tree`)."""

    #: the entry in the local tree (may be a symlink: copy what it points to)
    path: Path
    #: where it goes, relative to the destination root, ``/``-separated
    relative: str
    is_dir: bool


def walk_tree(root: Path) -> Iterator[TreeEntry]:
    """The entries :meth:`CommandRunner.put_tree` copies from ``root``, each directory before its contents.

    Symlinks are followed; a symlinked directory that leads back to one of its parents is skipped (with
    a warning), as are entries that are neither files nor directories (sockets, FIFOs). A broken symlink
    raises FileNotFoundError. Entries are in name order.
    """
    yield from _walk(root, "", frozenset())


def _walk(local: Path, prefix: str, ancestors: frozenset[tuple[int, int]]) -> Iterator[TreeEntry]:
    st = local.stat()
    ancestors = ancestors | {(st.st_dev, st.st_ino)}
    for entry in sorted(os.scandir(local), key=lambda e: e.name):
        path = Path(entry.path)
        relative = f"{prefix}{entry.name}"
        if not path.exists():
            raise FileNotFoundError(f"broken symlink {path} -> {os.readlink(path)}")
        if path.is_dir():
            sub = path.stat()
            if (sub.st_dev, sub.st_ino) in ancestors:
                log.warning("skipping %s: symlink loop back to one of its parents", path)
                continue
            yield TreeEntry(path, relative, True)
            yield from _walk(path, f"{relative}/", ancestors)
        elif path.is_file():
            yield TreeEntry(path, relative, False)
        else:
            log.warning("skipping %s: not a regular file or directory", path)
