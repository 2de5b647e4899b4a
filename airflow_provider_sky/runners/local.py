"""Run node scripts as local processes: the transport of the embedded local backend.

Each script runs in a process group of its own, so a call that is abandoned (its timeout, or its
caller cancelled it) kills the script and whatever it started in the foreground, then reaps it: a
status call that never answers must not leave a blocked ``sh`` behind, poll after poll. What a
script starts detached (``setsid``: ranks, the keeper, the delayed killer) lives on by design.

Copying files to a node is a plain copy into its home; a destination outside the home is refused, as
every local node shares this machine's filesystem.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import subprocess
from pathlib import Path

from airflow_provider_sky.errors import CommandTimeout
from airflow_provider_sky.runners.base import CALLS, CommandRunner, RunnerError, RunResult, walk_tree

log = logging.getLogger(__name__)

#: what a local rank inherits from the worker; everything else (AIRFLOW_CONN_*, tokens) stays out
_PASSED_ENV = ("PATH", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "VIRTUAL_ENV")

#: seconds to wait for a killed script to be reaped (SIGKILL is not ignorable: this is a bound, not a guess)
REAP_TIMEOUT = 5.0


def node_environment(home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _PASSED_ENV}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env["HOME"] = home
    return env


def _kill_group(pid: int) -> None:
    """SIGKILL the script's process group (the script leads it), falling back to the script alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _copy_file(src: Path, dest: Path, mode: int | None) -> None:
    """Content, permission bits and times of ``src`` (symlinks followed) onto the file ``dest``."""
    shutil.copyfile(src, dest)
    shutil.copystat(src, dest)
    if mode is not None:
        os.chmod(dest, mode)


class LocalRunner(CommandRunner):
    """A "node" on this machine: its own home directory and loopback IP."""

    def __init__(self, host: str, home: str) -> None:
        self.host = host
        self.home = home

    def _argv(self, args: list[str] | None) -> list[str]:
        return ["/bin/sh", "-s", "--", *(args or [])]

    def run_script(
        self, script: str, args: list[str] | None = None, timeout: float | None = None
    ) -> RunResult:
        CALLS.add(self.host)
        try:
            proc = subprocess.Popen(
                self._argv(args),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.home,
                env=node_environment(self.home),
                start_new_session=True,
            )
        except OSError as exc:
            raise RunnerError(self.host, str(exc)) from exc
        try:
            out, err = proc.communicate(script.encode(), timeout=timeout)
        except BaseException as exc:  # a timeout, or the caller interrupted: the script must not run on
            _kill_group(proc.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=REAP_TIMEOUT)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise CommandTimeout(self.host, f"timed out after {timeout}s") from exc
            raise
        return RunResult(proc.returncode, out, err)

    async def arun_script(
        self, script: str, args: list[str] | None = None, timeout: float | None = None
    ) -> RunResult:
        CALLS.add(self.host)
        try:
            proc = await asyncio.create_subprocess_exec(
                *self._argv(args),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=self.home,
                env=node_environment(self.home),
                start_new_session=True,
            )
        except OSError as exc:
            raise RunnerError(self.host, str(exc)) from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(script.encode()), timeout)
        except asyncio.TimeoutError as exc:
            await self._kill(proc)
            raise CommandTimeout(self.host, f"timed out after {timeout}s") from exc
        except asyncio.CancelledError:  # abandoned by the caller (a poll round's deadline)
            await self._kill(proc)
            raise
        return RunResult(proc.returncode if proc.returncode is not None else -1, out, err)

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        """Kill the script's process group and reap it, waiting at most :data:`REAP_TIMEOUT`."""
        _kill_group(proc.pid)
        try:
            await asyncio.wait_for(proc.wait(), REAP_TIMEOUT)
        except asyncio.TimeoutError:
            log.warning("%s: killed script (pid %s) not reaped within %ss", self.host, proc.pid, REAP_TIMEOUT)

    # -- files

    def _inside_home(self, remote: str | Path) -> Path:
        """Where ``remote`` is on this node: ``~``, ``~/x`` and relative paths are under the home.

        Refused (RunnerError) if it resolves outside the home, also through a symlink in the home.
        """
        home = Path(self.home).resolve()
        text = str(remote)
        if text == "~" or text.startswith("~/"):
            text = text[2:]
        target = (home / text).resolve()
        if target != home and home not in target.parents:
            raise RunnerError(
                self.host,
                f"{remote} resolves to {target}, outside the node's home {home}; copy to a path under the "
                "home that is not reached through a symlink leaving it",
            )
        return target

    def put_file(self, local: str | os.PathLike[str], remote: str, mode: int | None = None) -> None:
        """Copy one file into the node's home (parents created); keeps its permission bits and times
        unless ``mode`` is given (then the bits are ``mode``)."""
        CALLS.add(self.host)
        src = Path(local)
        dest = self._inside_home(remote)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            _copy_file(src, dest, mode)
        except OSError as e:
            raise RunnerError(self.host, f"copy of {src} to {remote} failed: {e}") from e

    def put_tree(self, local_path: str | os.PathLike[str], remote_path: str) -> int:
        """Copy a directory's contents into ``remote_path`` in the node's home; return files copied.

        Entries as :func:`~airflow_provider_sky.runners.base.walk_tree` gives them (symlinks followed,
        loops skipped); every destination must stay inside the home, also one reached through a symlink
        already in the destination tree.
        """
        src = Path(local_path)
        if not src.is_dir():
            self.put_file(src, remote_path)
            return 1
        CALLS.add(self.host)
        root = self._inside_home(remote_path)
        count = 0
        try:
            root.mkdir(parents=True, exist_ok=True)
            for entry in walk_tree(src):
                dest = self._inside_home(root / entry.relative)
                if entry.is_dir:
                    dest.mkdir(exist_ok=True)
                else:
                    _copy_file(entry.path, dest, None)
                    count += 1
        except OSError as e:
            raise RunnerError(self.host, f"copy of {src} to {remote_path} failed: {e}") from e
        return count
