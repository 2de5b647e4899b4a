"""Figure 1: fail-fast latency. One rank ``sleep 1; exit 1``, the others ``sleep 10000``.

Measured from the failing rank's own ``end`` timestamp (written by its wrapper on the node) to
(a) the last sibling ``sleep 10000`` process gone, seen in /proc every 5 ms by a watcher thread, and
(b) the last of the N rank triggers having fired its event (N SkyRankTrigger + 1 SkyGangTrigger under
Airflow's SharedStreamManager, as in a triggerer). The fail-fast itself is the triggers' shared poll
(``watch.watch``): default poll_interval 0.5 s, grace 3 s.

Phase: in a triggerer a rank fails at a random moment of the poll cycle. Here the failing rank waits
for a go-file in its home (the nodes' homes are on this machine) before its ``sleep 1; exit 1``; the
benchmark creates it a uniformly random 0..poll_interval seconds after the triggers started. Without
that, the failure would fall at the same point of the cycle every time (launch, then exactly 1 s), and
at N = 64 a warm launch (~0.8 s) would leave the triggers almost no time to start before it.

"Fails at once" (figure 1c, :func:`measure_at_once`): the failing rank's first command is ``exit 1``, so it
ends while the gang is still being started. The gang is started the way Airflow's ``job`` task starts it
(:func:`job_task`: ``SkyJobOperator.execute``, whose launch-side watcher launches it), and the triggers only
start ``trigger_delay`` seconds after that task ended (default :data:`TRIGGER_DELAY`: the gap between the
job task's end and the triggers' first poll under the real scheduler), so the figure shows whatever
watches the gang in between, or that nothing does.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.common import GoneWatcher, _stat, kill_job_processes, say
from benchmarks.triggers import run_shared, trigger_set

FAIL_RANK = 1
SLEEP_ARGV = ("sleep", "10000")
RUN = f"""if [ "$SKYPILOT_NODE_RANK" = "{FAIL_RANK}" ]; then
  i=0; while [ ! -e "$HOME/.bench-go-$SKYPILOT_TASK_ID" ] && [ $i -lt 3000 ]; do sleep 0.01; i=$((i + 1)); done
  sleep 1; exit 1
fi
sleep 10000
"""
_ids = itertools.count()


@dataclass
class Sample:
    gone: float | None  # (a) failing rank's end -> last sibling process gone
    events: float | None  # (b) failing rank's end -> last rank trigger event
    gang_event: float | None  # failing rank's end -> gang trigger event
    launch: float  # GangClient.launch wall time
    head_start: float  # failing rank's end - when the triggers were started (>0: they were in time)
    error: str | None = None
    cancel_sent: float | None = None  # failing rank's end -> the shared poll called acancel (detection)
    cancel_done: float | None = None  # failing rank's end -> acancel returned (siblings' exits recorded)


def one_run(
    backend: Any,
    handle: Any,
    n: int,
    *,
    sky_conn_id: str | None,
    poll_interval: float,
    rng: random.Random,
    grace: float = 3.0,
) -> Sample:
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.jobs import GangClient

    job_id = f"ff{n}-{next(_ids)}-{int(time.time() * 1000) % 10**8}"
    spec = task_from_args(num_nodes=n, run=RUN)
    client = GangClient(backend, handle)
    cancels: list[tuple[float, float]] = []
    original = GangClient.acancel

    async def timed_acancel(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.time()
        try:
            return await original(self, *args, **kwargs)
        finally:
            cancels.append((t, time.time()))

    watcher = GoneWatcher(job_id, n - 1, SLEEP_ARGV)
    watcher.start()
    try:
        t0 = time.monotonic()
        client.launch(spec, job_id)
        launch = time.monotonic() - t0
        triggers = trigger_set(
            handle.to_dict(), job_id, n, sky_conn_id=sky_conn_id, poll_interval=poll_interval, grace=grace
        )
        go = Path(handle.nodes[FAIL_RANK].home) / f".bench-go-{job_id}"
        delay = rng.uniform(0.0, poll_interval)

        async def release() -> None:
            await asyncio.sleep(delay)
            go.touch()

        started = time.time()
        GangClient.acancel = timed_acancel  # type: ignore[method-assign]
        try:
            results = asyncio.run(run_shared(triggers, timeout=60 + 2 * grace, alongside=release))
        finally:
            GangClient.acancel = original  # type: ignore[method-assign]
            go.unlink(missing_ok=True)
        watcher.join(30)
        if any(r is None for r in results):
            return Sample(None, None, None, launch, 0.0, "a trigger fired no event")
        events = [r for r in results if r is not None]
        failed = events[FAIL_RANK][1]
        if failed["state"] != "failed" or failed.get("end") is None:
            return Sample(None, None, None, launch, 0.0, f"rank {FAIL_RANK} is {failed['state']}")
        states = [e[1]["state"] for e in events[:n]]
        if states.count("cancelled") != n - 1:
            return Sample(None, None, None, launch, 0.0, f"rank states {states}")
        end = float(failed["end"])
        last_rank_event = max(t for t, _ in events[:n])
        gone = watcher.gone_at - end if watcher.gone_at is not None else None
        first_cancel = min(cancels) if cancels else None
        return Sample(
            cancel_sent=first_cancel[0] - end if first_cancel else None,
            cancel_done=first_cancel[1] - end if first_cancel else None,
            gone=gone,
            events=last_rank_event - end,
            gang_event=events[n][0] - end,
            launch=launch,
            head_start=end - started,
            error=watcher.error,
        )
    finally:
        watcher.stop()
        if kill_job_processes(job_id):
            say(f"  (killed leftovers of {job_id})")
        client.close()


def measure(
    backend: Any,
    handle: Any,
    n: int,
    reps: int,
    *,
    sky_conn_id: str | None,
    poll_interval: float,
    label: str,
) -> list[Sample]:
    out = []
    rng = random.Random(f"{label}-{n}-{poll_interval}")  # the same phases on every invocation
    for i in range(reps):
        s = one_run(backend, handle, n, sky_conn_id=sky_conn_id, poll_interval=poll_interval, rng=rng)
        flag = ""
        if s.error:
            flag = f"  ERROR {s.error}"
        elif s.head_start <= 0:
            flag = "  (triggers started after the failure: sample dropped)"
        say(
            f"  fig1 {label} N={n} poll={poll_interval} #{i + 1}: gone {_f(s.gone)}, events {_f(s.events)}, "
            f"gang {_f(s.gang_event)}, cancel sent {_f(s.cancel_sent)} returned {_f(s.cancel_done)}, "
            f"launch {s.launch:.2f}s{flag}"
        )
        out.append(s)
    return out


def valid(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if not s.error and s.head_start > 0 and s.gone is not None]


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}s"


# ------------------------------------------------------------------------ 1c: the rank fails at once

RUN_AT_ONCE = f"""if [ "$SKYPILOT_NODE_RANK" = "{FAIL_RANK}" ]; then exit 1; fi
sleep 10000
"""
#: Seconds between the job task's end and the triggers' first poll under the real scheduler + triggerer
#: (scheduler loop, the rank tasks queued, started and deferred, the triggerer picking them up). The
#: issue's seed scenario under the real scheduler lost 6.2 s from rank 2's exit to its siblings gone, of
#: which ~0.5 s was the rest of the job task after the exit and ~0.1-0.5 s the poll and the cancel.
TRIGGER_DELAY = 5.0
DAG_ID = "bench_ff_at_once"


@dataclass
class _TI:
    """What ``SkyJobOperator`` reads of its task instance (the job id is built from these)."""

    dag_id: str
    run_id: str
    task_id: str = "job"
    map_index: int = -1
    try_number: int = 1
    stats_tags: dict[str, str] = field(default_factory=dict)
    pushed: dict[str, Any] = field(default_factory=dict)

    def xcom_push(self, key: str, value: Any) -> None:
        """The job task pushes the job id alone (``sky_job_id``) for triggers started in the triggerer."""
        self.pushed[key] = value


def job_task(handle: Any, n: int, run_id: str, sky_conn_id: str | None) -> str:
    """Airflow's ``job`` task of ``sky_gang``, as a worker runs it; returns the job id.

    ``SkyJobOperator.execute`` (``ResumableJobMixin``: ``submit_job`` → ``GangClient.launch``, then
    ``poll_until_complete`` and ``get_job_result``), with the task instance's ids and an in-memory task
    state store, inside the task runner's guard (no "called outside of the Task Runner" warning).
    ``submit_job`` starts the launch-side watcher (``airflow_provider_sky.watch.bridge``, a detached process
    that launches the gang and watches it until the triggers take over), exactly as in a worker: nothing
    is added by hand. Its pid goes to :data:`BRIDGES`, so a run can check that it ended with the job.
    """
    import contextvars

    from airflow.sdk.bases.operator import ExecutorSafeguard

    from airflow_provider_sky.operators.job import SkyJobOperator

    op = SkyJobOperator(
        task_id="job", cluster=handle.to_dict(), run=RUN_AT_ONCE, num_nodes=n, sky_conn_id=sky_conn_id
    )
    ti = _TI(DAG_ID, run_id)
    context = {"ti": ti, "task_instance": ti, "run_id": run_id, "task_state_store": _StateStore()}
    run = contextvars.copy_context().run  # as the task runner does
    run(ExecutorSafeguard.tracker.set, op)
    ranks = run(op.execute, context)
    if op.bridge_pid is not None:
        BRIDGES.append(op.bridge_pid)
    return str(ranks[0]["job_id"])


#: pids of the bridges the job tasks of this process started (see :func:`bridge_left`)
BRIDGES: list[int] = []


def bridge_left(pid: int, wait: float = 10.0) -> bool:
    """True (after SIGKILLing it) when a bridge still runs ``wait`` s after its job ended."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X"):
            return False
        time.sleep(0.05)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    return True


class _StateStore:
    """The task's ``task_state_store`` (where ``ResumableJobMixin`` keeps the job id), in memory."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value


def _sibling_processes(job_id: str, argv: tuple[str, ...], skip_rank: int) -> dict[int, tuple[int, int]]:
    """pid -> (start time, rank) of the job's processes running exactly ``argv`` (ranks but ``skip_rank``)."""
    want_cmd = b"\0".join(a.encode() for a in argv) + b"\0"
    marker = f"SKYPILOT_TASK_ID={job_id}".encode()
    found: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                if fh.read() != want_cmd:
                    continue
            with open(f"/proc/{name}/environ", "rb") as fh:
                env = fh.read().split(b"\0")
        except OSError:
            continue
        if marker not in env:
            continue
        rank = next(
            (int(e[19:]) for e in env if e.startswith(b"SKYPILOT_NODE_RANK=") and e[19:].isdigit()), -1
        )
        st = _stat(int(name))
        if rank != skip_rank and st is not None and st[0] != "Z":
            found[int(name)] = (st[1], rank)
    return found


class SiblingTracker(threading.Thread):
    """Every sibling ``sleep 10000`` of a job from before its launch on; when the last one was gone.

    Unlike :class:`GoneWatcher` it never waits to have seen all N-1 first: a launch-side watcher may
    kill a sibling within milliseconds of its start, or before its command ever runs. It scans /proc
    for the job's processes (every ``scan`` s, only while some sibling rank has not been seen) and
    checks the ones it found every ``tick`` s. ``gone_at``: the wall time of the last check that saw
    the last live one gone; ``None`` when none was ever seen (then :attr:`first_empty_after_launch`).
    """

    def __init__(
        self, job_id: str, siblings: int, *, tick: float = 0.005, scan: float = 0.02, limit: float = 180.0
    ) -> None:
        super().__init__(daemon=True, name=f"sibling-tracker-{job_id}")
        self.job_id = job_id
        self.siblings = siblings
        self.tick = tick
        self.scan = scan
        self.limit = limit
        self.launch_done = threading.Event()
        self.stop_flag = threading.Event()
        self.alive: dict[int, tuple[int, int]] = {}
        self.seen: set[tuple[int, int]] = set()  # (pid, start time)
        self.seen_ranks: set[int] = set()
        self.gone_at: float | None = None
        self.first_empty_after_launch: float | None = None
        self.error: str | None = None

    def _add(self, found: dict[int, tuple[int, int]]) -> None:
        for pid, (start, rank) in found.items():
            if (pid, start) not in self.seen:
                self.seen.add((pid, start))
                self.seen_ranks.add(rank)
                self.alive[pid] = (start, rank)

    def run(self) -> None:
        deadline = time.monotonic() + self.limit
        last_scan = 0.0
        while not self.stop_flag.is_set():
            for pid, (start, _) in list(self.alive.items()):
                st = _stat(pid)
                if st is None or st[0] in ("Z", "X") or st[1] != start:
                    del self.alive[pid]
            if len(self.seen_ranks) < self.siblings and time.monotonic() - last_scan >= self.scan:
                self._add(_sibling_processes(self.job_id, SLEEP_ARGV, FAIL_RANK))
                last_scan = time.monotonic()
            now = time.time()
            if self.alive:
                self.gone_at = None
            elif self.seen and self.gone_at is None:
                self.gone_at = now
            if not self.alive and self.launch_done.is_set() and self.first_empty_after_launch is None:
                self.first_empty_after_launch = now
            if time.monotonic() > deadline:
                self.error = f"still tracking after {self.limit}s ({len(self.alive)} alive)"
                return
            time.sleep(self.tick)

    def finish(self) -> None:
        """Stop, then one last full scan: a sibling still running is an error (nothing killed it)."""
        self.stop_flag.set()
        self.join(5)
        left = _sibling_processes(self.job_id, SLEEP_ARGV, FAIL_RANK)
        if left and not self.error:
            self.error = f"{len(left)} sibling processes still running at the end (ranks {sorted(r for _, r in left.values())})"


@dataclass
class OnceSample:
    """Times from the failing rank's own ``end`` timestamp (its ``exit 1`` at launch)."""

    gone: float | None  # -> last sibling process gone (the figure)
    events: float | None  # -> last of the N rank triggers' events
    gang_event: float | None  # -> the gang trigger's event
    job_end: float | None  # -> the job task returned
    triggers_start: float | None  # -> the triggers subscribed (job end + trigger_delay)
    cancel_sent: float | None  # -> the first GangClient.acancel in this process after the triggers started
    launch: float  # the job task's wall time
    seen: int  # sibling processes the tracker saw running (N-1 when every sibling started its command)
    error: str | None = None
    job_error: str | None = None  # the job task raised (kept: failing the gang there may be by design)


def one_run_at_once(
    handle: Any,
    n: int,
    *,
    sky_conn_id: str | None,
    poll_interval: float,
    trigger_delay: float = TRIGGER_DELAY,
    grace: float = 3.0,
) -> OnceSample:
    from airflow_provider_sky.model.gang import job_id_for
    from airflow_provider_sky.runners import ssh
    from airflow_provider_sky.watch.jobs import GangClient

    run_id = f"ff-once-{n}-{next(_ids)}-{int(time.time() * 1000) % 10**8}"
    job_id = job_id_for(DAG_ID, run_id, "job", -1, 1)
    tracker = SiblingTracker(job_id, n - 1)
    cancels: list[float] = []
    original = GangClient.acancel

    async def timed_acancel(self: Any, *args: Any, **kwargs: Any) -> Any:
        cancels.append(time.time())
        return await original(self, *args, **kwargs)

    def failed(why: str, launch: float = 0.0) -> OnceSample:
        return OnceSample(None, None, None, None, None, None, launch, len(tracker.seen), why)

    if sky_conn_id:
        ssh.close_all()  # a worker runs the job task in a fresh process: its SSH connections are cold
    tracker.start()
    try:
        t0 = time.time()
        job_error = None
        try:
            got = job_task(handle, n, run_id, sky_conn_id)
        except Exception as exc:  # e.g. the job task failing the gang itself: still watch what follows
            job_error = f"job task raised {type(exc).__name__}: {exc}"
        else:
            if got != job_id:
                return failed(f"the job task started job {got}, not {job_id}")
        job_end = time.time()
        tracker.launch_done.set()
        time.sleep(max(0.0, job_end + trigger_delay - time.time()))
        triggers = trigger_set(
            handle.to_dict(), job_id, n, sky_conn_id=sky_conn_id, poll_interval=poll_interval, grace=grace
        )
        started = time.time()
        GangClient.acancel = timed_acancel  # type: ignore[method-assign]
        try:
            results = asyncio.run(run_shared(triggers, timeout=60 + 2 * grace))
        finally:
            GangClient.acancel = original  # type: ignore[method-assign]
        tracker.finish()
        launch = job_end - t0
        if any(r is None for r in results):
            return failed("a trigger fired no event", launch)
        events = [r for r in results if r is not None]
        fail = events[FAIL_RANK][1]
        if fail["state"] != "failed" or fail.get("end") is None:
            return failed(f"rank {FAIL_RANK} is {fail['state']}", launch)
        states = [e[1]["state"] for e in events[:n]]
        if states.count("cancelled") != n - 1:
            return failed(f"rank states {states}", launch)
        end = float(fail["end"])
        gone_at = tracker.gone_at if tracker.seen else tracker.first_empty_after_launch
        return OnceSample(
            gone=gone_at - end if gone_at is not None else None,
            events=max(t for t, _ in events[:n]) - end,
            gang_event=events[n][0] - end,
            job_end=job_end - end,
            triggers_start=started - end,
            cancel_sent=cancels[0] - end if cancels else None,
            launch=launch,
            seen=len(tracker.seen),
            error=tracker.error,
            job_error=job_error,
        )
    finally:
        tracker.stop_flag.set()
        if kill_job_processes(job_id):
            say(f"  (killed leftovers of {job_id})")
        while BRIDGES:
            pid = BRIDGES.pop()
            if bridge_left(pid):
                say(f"  (the bridge {pid} of {job_id} outlived its job: killed)")


def measure_at_once(
    handle: Any,
    n: int,
    reps: int,
    *,
    sky_conn_id: str | None,
    poll_interval: float,
    trigger_delay: float,
    label: str,
) -> list[OnceSample]:
    out = []
    for i in range(reps):
        s = one_run_at_once(
            handle, n, sky_conn_id=sky_conn_id, poll_interval=poll_interval, trigger_delay=trigger_delay
        )
        flag = f"  ERROR {s.error}" if s.error else ""
        flag += f"  ({s.job_error})" if s.job_error else ""
        say(
            f"  fig1c {label} N={n} at once, triggers +{trigger_delay:g}s #{i + 1}: gone {_f(s.gone)} "
            f"(job task ended {_f(s.job_end)}, triggers {_f(s.triggers_start)}, cancel sent {_f(s.cancel_sent)}), "
            f"events {_f(s.events)}, {s.seen}/{n - 1} siblings seen running, job task {s.launch:.2f}s{flag}"
        )
        out.append(s)
    return out


def valid_at_once(samples: list[OnceSample]) -> list[OnceSample]:
    return [s for s in samples if not s.error and s.gone is not None]
