"""Run node scripts as local processes: the transport of the embedded local backend."""

from __future__ import annotations

import asyncio
import os
import subprocess

from airflow_provider_sky.runners.base import CALLS, CommandRunner, RunnerError, RunResult

#: what a local rank inherits from the worker; everything else (AIRFLOW_CONN_*, tokens) stays out
_PASSED_ENV = ("PATH", "USER", "LOGNAME", "SHELL", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM", "VIRTUAL_ENV")


def node_environment(home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _PASSED_ENV}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env["HOME"] = home
    return env


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
            proc = subprocess.run(
                self._argv(args),
                input=script.encode(),
                capture_output=True,
                cwd=self.home,
                env=node_environment(self.home),
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RunnerError(self.host, str(exc)) from exc
        return RunResult(proc.returncode, proc.stdout, proc.stderr)

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
            )
        except OSError as exc:
            raise RunnerError(self.host, str(exc)) from exc
        try:
            out, err = await asyncio.wait_for(proc.communicate(script.encode()), timeout)
        except asyncio.TimeoutError as exc:
            proc.kill()
            await proc.wait()
            raise RunnerError(self.host, f"timed out after {timeout}s") from exc
        return RunResult(proc.returncode if proc.returncode is not None else -1, out, err)
