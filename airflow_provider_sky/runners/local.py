"""Run node scripts as local processes: the transport of the embedded local backend.

Each script runs in a process group of its own, so a call that is abandoned (its timeout, or its
caller cancelled it) kills the script and whatever it started in the foreground, then reaps it: a
status call that never answers must not leave a blocked ``sh`` behind, poll after poll. What a
script starts detached (``setsid``: ranks, the keeper, the delayed killer) lives on by design.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess

from airflow_provider_sky.runners.base import CALLS, CommandRunner, RunnerError, RunResult

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
                raise RunnerError(self.host, f"timed out after {timeout}s") from exc
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
            raise RunnerError(self.host, f"timed out after {timeout}s") from exc
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
