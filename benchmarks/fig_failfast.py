"""Figure 1: fail-fast latency. One rank ``sleep 1; exit 1``, the others ``sleep 10000``.

Measured from the failing rank's own ``end`` timestamp (written by its wrapper on the node) to
(a) the last sibling ``sleep 10000`` process gone, seen in /proc every 5 ms by a watcher thread, and
(b) the last of the N rank triggers having fired its event (N SkyRankTrigger + 1 SkyGangTrigger under
Airflow's SharedStreamManager, as in a triggerer). The fail-fast itself is the triggers' shared poll
(``jobs.watch``): default poll_interval 0.5 s, grace 3 s.

Phase: in a triggerer a rank fails at a random moment of the poll cycle. Here the failing rank waits
for a go-file in its home (the nodes' homes are on this machine) before its ``sleep 1; exit 1``; the
benchmark creates it a uniformly random 0..poll_interval seconds after the triggers started. Without
that, the failure would fall at the same point of the cycle every time (launch, then exactly 1 s), and
at N = 64 a warm launch (~0.8 s) would leave the triggers almost no time to start before it.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import GoneWatcher, kill_job_processes, say
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
    from airflow_provider_sky.jobs import GangClient
    from airflow_provider_sky.spec import task_from_args

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
