"""Run node scripts in a pod through the Kubernetes exec API (no SSH, no port-forward).

The script goes on stdin behind a length prefix: ``sh -c 'head -c N | sh -s -- ARGS'``. The exec
websocket's v4 protocol (API servers before 1.30) cannot half-close stdin, so a plain ``sh -s`` would
wait for an EOF that never comes (tests/k8s/NOTES.md); the byte count on the command line reveals
nothing, and the script (secrets included) stays off the exec URL, where argv travels.

Every call opens its own websocket on a fresh ``ApiClient`` (``stream()`` swaps ``call_api`` on the
client it is given, so a shared client would send concurrent REST calls over a websocket). Calls are
short: the rank itself is detached by the node runtime, so an idle exec session never has to live long.
A call with a timeout is killed in the pod at its limit (the whole process group of the exec), so a call we
gave up on does not go on running there.
"""

from __future__ import annotations

import asyncio
import functools
import io
import os
import re
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from airflow_provider_sky.errors import CommandTimeout
from airflow_provider_sky.runners.base import CALLS, CommandRunner, RunnerError, RunResult

#: attempts to open an exec stream (nothing has run until it is open)
OPEN_TRIES = 3
#: stdin is sent in frames of this size
_FRAME = 64 * 1024
#: the wrapper: $1 bytes of script on stdin, $2 seconds (0: no limit), then the script's own args. Each exec
#: is a session and process group of its own (the runtime's pid 0 child): at the limit a watcher kills the
#: whole group, the script's children included (a rank the script started with ``setsid`` is in its own
#: session and stays); the watcher, which holds none of the stream's descriptors, ends with the script.
_WRAPPER = (
    'n=$1; t=$2; shift 2; w=; if [ "$t" != 0 ]; then '
    "( trap 'kill $s 2>/dev/null; exit 0' TERM; sleep \"$t\" & s=$!; wait $s && kill -KILL -$$ ) "
    "</dev/null >/dev/null 2>&1 & w=$!; fi; "
    'head -c "$n" | sh -s -- "$@"; rc=$?; [ -z "$w" ] || kill "$w" 2>/dev/null; exit $rc'
)
_EXECUTOR_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None
EXECUTOR_THREADS = 64


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(EXECUTOR_THREADS, thread_name_prefix="sky-kube-exec")
        return _EXECUTOR


class _Transient(Exception):
    """The exec stream could not be opened for a reason that may pass (nothing ran)."""


class _Cancel:
    """Set by an abandoned async call: its thread closes the websocket and returns."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.sock: Any = None

    def set(self) -> None:
        self.event.set()
        sock = self.sock
        if sock is not None:
            try:
                sock.close()
            except Exception:
                pass


def _exit_code(error_channel: bytes | str, host: str) -> int:
    """The exit status from the exec error channel; nothing there is a transport error, never success."""
    if not error_channel:
        raise RunnerError(host, "the exec stream closed without an exit status (connection dropped)")
    status = yaml.safe_load(error_channel)
    if not isinstance(status, dict):
        raise RunnerError(host, f"unreadable exec status: {error_channel!r}")
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause.get("message", 1))
    raise RunnerError(host, f"exec failed: {status.get('message') or status}")


def _drop_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class KubernetesRunner(CommandRunner):
    """Scripts in one container of one pod, each call its own exec stream."""

    def __init__(self, api_client_factory: Any, namespace: str, pod: str, container: str, host: str) -> None:
        #: builds a fresh ``kubernetes.client.ApiClient`` per call (isolated config, never the global one)
        self._new_client = api_client_factory
        self.namespace = namespace
        self.pod = pod
        self.container = container
        self.host = host

    def __repr__(self) -> str:
        return f"KubernetesRunner({self.namespace}/{self.pod})"

    def _open(self, command: list[str]) -> Any:
        """The exec stream; a stream that could not be opened (nothing ran yet) is tried again, with
        backoff, ``OPEN_TRIES`` times in all: an API server restarting or a dropped connection heals."""
        for attempt in range(OPEN_TRIES):
            try:
                return self._open_once(command)
            except _Transient as exc:
                if attempt == OPEN_TRIES - 1:
                    raise RunnerError(self.host, str(exc)) from None
                time.sleep(0.2 * 2**attempt)
        raise AssertionError("unreachable")

    def _open_once(self, command: list[str]) -> Any:
        from kubernetes import client
        from kubernetes.client.rest import ApiException
        from kubernetes.stream import stream

        core = client.CoreV1Api(self._new_client())
        try:
            return stream(
                core.connect_get_namespaced_pod_exec,
                self.pod,
                self.namespace,
                container=self.container,
                command=command,
                stdin=True,
                stdout=True,
                stderr=True,
                tty=False,
                binary=True,
                _preload_content=False,
            )
        except ApiException as exc:
            # the websocket client reports every failure as status 0; a handshake refused with 4xx (a pod
            # that is gone, forbidden) will not heal, a dropped or refused connection may
            message = f"exec into pod {self.namespace}/{self.pod} failed: {exc.reason}"
            if exc.status == 0 and not re.search(r"Handshake status 4\d\d", str(exc.reason)):
                raise _Transient(message) from None
            raise RunnerError(self.host, message) from None
        except Exception as exc:  # websocket errors: refused, TLS, DNS
            raise _Transient(f"exec into pod {self.namespace}/{self.pod} failed: {exc}") from None

    def _call(
        self, stdin: bytes, command: list[str], timeout: float | None, cancel: _Cancel | None = None
    ) -> RunResult:
        CALLS.add(self.host)
        ws = self._open(command)
        if cancel is not None:
            cancel.sock = ws
        deadline = None if timeout is None else time.monotonic() + timeout
        out, err = bytearray(), bytearray()
        try:
            for i in range(0, len(stdin), _FRAME):
                ws.write_stdin(stdin[i : i + _FRAME])
            while ws.is_open():
                if cancel is not None and cancel.event.is_set():
                    raise RunnerError(self.host, "call abandoned")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CommandTimeout(self.host, f"command timed out after {timeout:g}s")
                ws.update(timeout=min(1.0, left) if left is not None else 1.0)
                # timeout=0: the client's own default (None) blocks until the next frame, which a silent
                # stream (a stopped kubelet, a dropped link) never sends: past our deadline and forever
                out += ws.read_stdout(timeout=0) or b""
                err += ws.read_stderr(timeout=0) or b""
            out += ws.read_stdout(timeout=0) or b""
            err += ws.read_stderr(timeout=0) or b""
            code = _exit_code(ws.read_channel(3, timeout=0), self.host)
        except RunnerError:
            raise
        except Exception as exc:
            raise RunnerError(self.host, f"exec stream failed: {exc}") from None
        finally:
            ws.close()
        return RunResult(code, bytes(out), bytes(err))

    def run_script(
        self,
        script: str,
        args: list[str] | None = None,
        timeout: float | None = None,
        *,
        cancel: _Cancel | None = None,
    ) -> RunResult:
        data = script.encode()
        limit = "0" if timeout is None else str(max(1, int(timeout) + 1))
        command = ["sh", "-c", _WRAPPER, "sky", str(len(data)), limit, *(args or [])]
        return self._call(data, command, timeout, cancel)

    async def arun_script(
        self, script: str, args: list[str] | None = None, timeout: float | None = None
    ) -> RunResult:
        """:meth:`run_script` on the runner's thread pool; cancelling it closes the stream."""
        loop = asyncio.get_running_loop()
        cancel = _Cancel()
        fut = loop.run_in_executor(
            _executor(), functools.partial(self.run_script, script, args, timeout, cancel=cancel)
        )
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancel.set()
            # the thread ends on its own ("call abandoned", or the closed socket's error): nobody awaits
            # it now, so take its outcome here instead of asyncio's "exception was never retrieved"
            fut.add_done_callback(_drop_outcome)
            raise

    # -- files: a tar stream over exec --------------------------------------------------------------------

    def _put_tar(self, data: bytes, remote_dir: str) -> None:
        command = [
            "sh",
            "-c",
            'mkdir -p "$2" && head -c "$1" | tar -xf - -C "$2"',
            "sky",
            str(len(data)),
            remote_dir,
        ]
        res = self._call(data, command, timeout=300)
        if res.returncode != 0:
            raise RunnerError(self.host, f"copying into {remote_dir} failed: {res.error_text}")

    def put_file(self, local: str | os.PathLike[str], remote: str, mode: int | None = None) -> None:
        src = Path(local)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            info = tar.gettarinfo(str(src), arcname=os.path.basename(remote))
            if mode is not None:
                info.mode = mode
            with src.open("rb") as fh:
                tar.addfile(info, fh)
        self._put_tar(buf.getvalue(), os.path.dirname(remote) or ".")

    def put_tree(self, local_path: str | os.PathLike[str], remote_path: str) -> int:
        src = Path(local_path)
        buf = io.BytesIO()
        count = 0
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for path in sorted(src.rglob("*")):
                tar.add(str(path), arcname=str(path.relative_to(src)), recursive=False)
                count += path.is_file() and not path.is_symlink()
        self._put_tar(buf.getvalue(), remote_path)
        return count
