"""The launch-side watcher ("bridge"): fail-fast from the first instant, until the triggers take over.

Why it exists: the ``job`` task starts every rank, but the rank tasks and the gang sensor (whose
triggers run the fail-fast) are mapped over its output, so they only start after it ended: seconds
later under a scheduler, during which nothing would watch the gang. So the job task starts this
small detached process *before* the launch. The bridge launches the gang itself (it watches from the
instant the ranks exist, with its connections already open) and then runs the same loop as the
triggers' shared poll (:func:`watch.watch`, fail-fast included).

Handover: the bridge's polls never leave the poller's clock on the nodes (``mark=False``), so it never
keeps an abandoned job alive against the node's dead-man's switch. The triggers' shared poll does
leave it (``RankStatus.polled_at``). Once the bridge sees that mark change twice within
``stale_after`` (a watcher polling steadily, not a one-off look) it steps back to a cheap call on
one node twice per interval; as soon as the marks go stale (a triggerer restart, the gap between two rank
triggers under ``dag.test()``) it polls every node again. It exits when the job is over (its own
cancel included), when the cluster is gone, or after ``bridge_timeout`` seconds in which no other
watcher was seen.

Protocol: the request is one JSON document on stdin (never argv, never a file: a backend config may
hold a private key); the answer is one JSON line on stdout once the launch is done,
``{"started": {rank: "STARTED"|"EXISTS"}, "pid": ...}``, ``{"watching": true, "pid": ...}`` (no
launch asked) or ``{"error": "...", "launch_failed": bool}``. Its stderr is a log file chosen by the
caller (job id, states, counts; never a secret). This module never imports Airflow.

Run as ``python -m airflow_provider_sky.watch.bridge``; :func:`start_bridge` is the caller's side.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import select
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from airflow_provider_sky.backends import ClusterHandle, make_backend
from airflow_provider_sky.errors import BridgeError as BridgeError
from airflow_provider_sky.model.gang import RankStatus
from airflow_provider_sky.watch.jobs import (
    DEFAULT_ORPHAN_TIMEOUT,
    GangClient,
    LaunchError,
    Poll,
)
from airflow_provider_sky.watch.retry import AttemptState, RetryPolicy, watch_attempts

log = logging.getLogger("airflow_provider_sky.watch.bridge")

MODULE = "airflow_provider_sky.watch.bridge"
#: how long the caller waits for the launch's answer: the launch itself is bounded by 60 s per node
ANSWER_TIMEOUT = 180.0
#: bridge logs older than this are removed when a new bridge starts
LOG_KEEP = 7 * 24 * 3600.0


# ------------------------------------------------------------------------------------ the handover


@dataclass
class Handover:
    """Whether another watcher polls the job steadily: its clock, left on the nodes, keeps advancing.

    A change counts when the newest mark on any rank is later than every mark seen before by more
    than a quarter of ``stale_after`` (the ranks of one poll get marks microseconds apart; the next
    poll comes an interval later). Changes are timed by our own clock, as the other watcher may run
    on another machine; its period is the difference of two of its marks (skew-free). The marks are
    stale once none advanced for ``stale_after`` seconds, or 1.5 of its periods if that is longer (a
    slow poll of many nodes is not a lapse). Two changes within that limit are needed to step back:
    a one-off look (a rank task checking whether its rank is over) is not a watcher.
    """

    stale_after: float
    clock: Callable[[], float] = time.monotonic
    newest: float | None = None
    changes: list[float] = field(default_factory=list)
    period: float = 0.0

    def observe(self, ranks: Iterable[RankStatus]) -> None:
        marks = [r.polled_at for r in ranks if r.polled_at is not None]
        if not marks:
            return
        top = max(marks)
        if self.newest is None:
            self.newest = top  # the launch's own mark, or whoever polled last
        elif top > self.newest + self.stale_after / 4:
            self.period = min(top - self.newest, 5 * self.stale_after)
            self.newest = top
            self.changes = [*self.changes[-1:], self.clock()]

    @property
    def limit(self) -> float:
        return max(self.stale_after, 1.5 * self.period)

    def active(self) -> bool:
        if len(self.changes) < 2:
            return False
        before, last = self.changes
        return self.clock() - last <= self.limit and last - before <= self.limit


class _QuietClient(GangClient):
    """The bridge's client: its polls never read log bytes and never leave a mark on the nodes."""

    async def apoll(
        self,
        job_id: str,
        offsets: Mapping[int, int] | None = None,
        max_log: int = 0,
        ranks: Sequence[int] | None = None,
        *,
        mark: bool = False,
    ) -> Poll:
        return await super().apoll(job_id, offsets, 0, ranks, mark=False)


def _cluster_gone(client: GangClient) -> bool:
    """True when the backend no longer knows the cluster (torn down under the job)."""
    try:
        return client.backend.find(client.handle.name) is None
    except Exception:  # the backend cannot tell (e.g. its head does not answer): keep watching
        return False


async def bridge_watch(
    client: GangClient,
    job_id: str,
    *,
    poll_interval: float = 0.5,
    grace: float = 3.0,
    lost_after: float = 10.0,
    bridge_timeout: float = DEFAULT_ORPHAN_TIMEOUT,
    stale_after: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    hang_timeout: float = 0.0,
    policy: RetryPolicy | None = None,
) -> str:
    """Watch the job (fail-fast, hangs and retries included) while nobody else does. Returns why it stopped.

    ``"done"``: the gang's outcome is final (every rank of its last attempt is terminal). ``"timeout"``: no other watcher was seen for
    ``bridge_timeout`` seconds. ``"gone"``: the cluster was torn down.
    """
    st = AttemptState()  # attempts, silence timers and offsets kept across the re-entries below
    hand = Handover(stale_after if stale_after is not None else 2 * poll_interval, clock)
    quiet_since = clock()
    terminal: set[int] = set()
    last_find = 0.0
    while True:
        async with contextlib.aclosing(
            watch_attempts(
                client,
                job_id,
                policy=policy,
                hang_timeout=hang_timeout,
                poll_interval=poll_interval,
                grace=grace,
                lost_after=lost_after,
                state=st,
                mark=False,
            )
        ) as polls:
            async for poll in polls:
                if poll.final:
                    log.info("Job %s is over: %s", st.current_id, _states(poll.status.ranks))
                    return "done"
                if not poll.status.done:
                    terminal = {r.rank for r in poll.status.ranks if r.terminal}
                hand.observe(r for r in poll.status.ranks if r.rank not in poll.unreachable)
                if hand.active():
                    break
                if len(poll.unreachable) == client.num_ranks and clock() - last_find >= 5 * poll_interval:
                    last_find = clock()
                    if await asyncio.to_thread(_cluster_gone, client):
                        log.info("Cluster %s is gone; nothing left to watch", client.handle.name)
                        return "gone"
                if clock() - quiet_since >= bridge_timeout:
                    log.info(
                        "No other watcher of job %s for %.0fs: leaving it to the nodes",
                        job_id,
                        bridge_timeout,
                    )
                    return "timeout"
        log.info("Another watcher polls job %s: stepping back to one node, twice per interval", job_id)
        while True:
            quiet_since = clock()
            # twice the other watcher's pace, so a lapse shows within about two intervals
            await asyncio.sleep(poll_interval / 2)
            probe = min((r for r in range(client.num_ranks) if r not in terminal), default=0)
            peek = await client.apoll(st.current_id, ranks=[probe])
            if peek.unreachable:
                break
            hand.observe(peek.status.ranks)
            if any(r.terminal for r in peek.status.ranks) or peek.status.cancel_requested:
                break  # look at every rank now: over, or a cancel to follow through
            if not hand.active():
                log.info("The other watcher of job %s stopped polling: watching every rank again", job_id)
                break


def _states(ranks: Iterable[RankStatus]) -> str:
    return ", ".join(f"{r.rank}={r.state}" for r in ranks)


# ------------------------------------------------------------------------------------ the process


@dataclass(frozen=True)
class BridgeRequest:
    """What the bridge needs; ``spec`` (the task, secrets included) asks it to launch the gang."""

    backend: str
    config: Mapping[str, Any]
    cluster: Mapping[str, Any]
    job_id: str
    spec: Mapping[str, Any] | None = None
    orphan_timeout: float = DEFAULT_ORPHAN_TIMEOUT
    idle_down: float = 0.0
    poll_interval: float = 0.5
    grace: float = 3.0
    lost_after: float = 10.0
    bridge_timeout: float = DEFAULT_ORPHAN_TIMEOUT
    hang_timeout: float = 0.0
    #: the whole-gang retry policy (``RetryPolicy.to_dict``), None: no retries
    retry: Mapping[str, Any] | None = None

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, default=dict).encode()

    @classmethod
    def from_json(cls, data: bytes) -> BridgeRequest:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("the request is not a JSON object")
        return cls(**raw)


async def serve(req: BridgeRequest, answer: Callable[[dict[str, Any]], None]) -> int:
    """Launch (when asked), answer, then watch. Returns the process's exit code."""
    from airflow_provider_sky.spec import parse_task

    backend = make_backend(req.backend, req.config)
    client = _QuietClient(backend, ClusterHandle.from_dict(req.cluster))
    policy = RetryPolicy.from_dict(req.retry)
    client.keep_secrets = policy.retries > 0  # later attempts start from the nodes' files
    try:
        if req.spec is not None:
            spec = parse_task(req.spec)
            log.info("Launching %s rank(s) of job %s", client.num_ranks, req.job_id)
            try:
                started = await client.alaunch(
                    spec,
                    req.job_id,
                    orphan_timeout=req.orphan_timeout,
                    idle_down=req.idle_down,
                    grace=req.grace,
                    hang_timeout=req.hang_timeout,
                    lost_after=req.lost_after,
                )
            except LaunchError as exc:
                message = spec.redacted(str(exc))
                log.info("Launch of job %s failed (every started rank cancelled): %s", req.job_id, message)
                answer({"error": message, "launch_failed": True})
                return 1
            answer({"started": {str(k): v for k, v in started.items()}, "pid": os.getpid()})
        else:
            answer({"watching": True, "pid": os.getpid()})
        outcome = await bridge_watch(
            client,
            req.job_id,
            poll_interval=req.poll_interval,
            grace=req.grace,
            lost_after=req.lost_after,
            bridge_timeout=req.bridge_timeout,
            hang_timeout=req.hang_timeout,
            policy=policy,
        )
        log.info("Bridge of job %s ends: %s", req.job_id, outcome)
        return 0
    finally:
        client.close()
        backend.close()


def _answerer(fd: int) -> Callable[[dict[str, Any]], None]:
    """Write the one answer line to ``fd`` and close it (later answers are dropped)."""
    done = False

    def answer(obj: dict[str, Any]) -> None:
        nonlocal done
        if done:
            return
        done = True
        with contextlib.suppress(OSError):
            os.write(fd, (json.dumps(obj) + "\n").encode())
        with contextlib.suppress(OSError):
            os.close(fd)

    return answer


def _lock_log() -> bool:
    """Hold a lock on our log file (stderr): a second bridge of the same job finds it held."""
    try:
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return True
        fcntl.flock(2, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def main() -> int:
    """Entry point of ``python -m airflow_provider_sky.watch.bridge``."""
    raw = sys.stdin.buffer.read()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    out_fd = os.dup(1)  # the answer goes here; anything else printed goes nowhere
    os.dup2(devnull, 1)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(process)d %(levelname)s %(message)s"
    )
    answer = _answerer(out_fd)
    try:
        req = BridgeRequest.from_json(raw)
    except (ValueError, TypeError) as exc:
        answer({"error": f"unreadable bridge request: {type(exc).__name__}"})
        return 2
    del raw
    if not _lock_log():
        log.info("Another bridge already watches job %s", req.job_id)
        answer({"watching": False, "error": f"another bridge already watches job {req.job_id}"})
        return 0

    async def run() -> int:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if task is not None:
                loop.add_signal_handler(sig, task.cancel)
        return await serve(req, answer)

    try:
        code = asyncio.run(run())
    except asyncio.CancelledError:
        log.info("Bridge of job %s stopped by a signal", req.job_id)
        code = 0
    except Exception as exc:
        log.exception("Bridge of job %s failed", req.job_id)
        answer({"error": f"{type(exc).__name__}: {exc}"})
        code = 2
    answer({"error": "the bridge ended without launching"})
    return code


# ------------------------------------------------------------------------------------ the caller's side


@dataclass
class Bridge:
    """A started bridge: its pid and its answer."""

    pid: int
    answer: dict[str, Any]
    log_path: Path | None
    proc: subprocess.Popen[bytes] = field(repr=False)


def bridge_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The bridge's environment: the worker's, without Airflow's config and connections (secrets)."""
    env = dict(os.environ if environ is None else environ)
    return {k: v for k, v in env.items() if "AIRFLOW" not in k.upper() or k == "AIRFLOW_HOME"}


def log_path_for(state_dir: str | os.PathLike[str] | None, job_id: str) -> Path | None:
    """``<state dir>/bridge/<job id>.log`` (old logs pruned); None when it cannot be made."""
    if state_dir is None:
        from airflow_provider_sky.backends.local import default_state_dir

        state_dir = default_state_dir()
    folder = Path(state_dir) / "bridge"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        cutoff = time.time() - LOG_KEEP
        for old in folder.glob("*.log"):
            with contextlib.suppress(OSError):
                if old.stat().st_mtime < cutoff:
                    old.unlink()
    except OSError:
        return None
    return folder / f"{job_id}.log"


def _read_line(stream: IO[bytes], timeout: float) -> bytes:
    """One line from a pipe, or what came before EOF or ``timeout``."""
    fd = stream.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0]


def start_bridge(
    req: BridgeRequest, *, log_path: Path | None = None, timeout: float = ANSWER_TIMEOUT
) -> Bridge:
    """Start a detached bridge, hand it ``req`` on stdin and wait for its answer.

    Raises :class:`LaunchError` when the bridge reports that the launch failed (every started rank
    was cancelled), :class:`BridgeError` when it gave no answer (it is killed then; the caller
    cancels whatever it may have started).
    """
    err: Any = subprocess.DEVNULL
    if log_path is not None:
        with contextlib.suppress(OSError):
            err = open(log_path, "ab")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", MODULE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd="/",
            env=bridge_env(),
            close_fds=True,
            start_new_session=True,  # its own session: the worker's end (or its group's kill) leaves it alone
        )
    except OSError as exc:
        raise BridgeError(f"could not start the launch-side watcher: {exc}") from exc
    finally:
        if err is not subprocess.DEVNULL:
            err.close()
    # reap it whenever it ends, so a long-lived caller (dag.test()) keeps no zombie
    threading.Thread(target=proc.wait, name=f"sky-bridge-{proc.pid}", daemon=True).start()
    assert proc.stdin is not None and proc.stdout is not None
    try:
        try:
            proc.stdin.write(req.to_json())
            proc.stdin.close()
        except OSError:
            pass  # it died at once: reported below as no answer
        line = _read_line(proc.stdout, timeout)
    finally:
        proc.stdout.close()
    try:
        answer = json.loads(line) if line else None
    except ValueError:
        answer = None
    where = f"; its log: {log_path}" if log_path is not None else ""
    if not isinstance(answer, dict):
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise BridgeError(f"the launch-side watcher gave no answer within {timeout:.0f}s{where}")
    if answer.get("launch_failed"):
        raise LaunchError(str(answer.get("error")))
    if "error" in answer and answer.get("watching") is not False:
        raise BridgeError(f"the launch-side watcher failed: {answer['error']}{where}")
    return Bridge(int(answer.get("pid") or proc.pid), answer, log_path, proc)


if __name__ == "__main__":
    _code = main()
    logging.shutdown()
    os._exit(_code)  # never wait for a transport's leftover threads
