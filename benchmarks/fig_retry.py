"""Figure 8: whole-gang retry over SSH: the failing rank's exit → every rank of the next attempt running.

Per gang size N on the sshd test hosts: attempt 1 runs ``sleep 10000`` on every rank but rank N-1, which
exits 1 after 2 s; the attempts loop of the shared poll (``retry.watch_attempts``, poll 0.5 s, grace 3 s,
``retries=1, retry_on_exit_codes=[1]``, no delay) cancels the siblings, checks that no process of attempt 1
is left, and starts attempt 2 (``sleep 10000`` everywhere). Measured from the ranks' own timestamps (every
host is this machine, one clock): rank N-1's end in attempt 1 → the last rank of attempt 2 started. The
loop stops once every rank of attempt 2 is seen running; attempt 2 is then cancelled and the cluster
torn down.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable
from typing import Any

from benchmarks.common import Row

RUN = """\
if [ "$SKY_ATTEMPT" = 1 ] && [ "$SKYPILOT_NODE_RANK" = "$((SKYPILOT_NUM_NODES - 1))" ]; then sleep 2; exit 1; fi
exec sleep 10000
"""


def _one(backend: Any, handle: Any, n: int, job: str) -> tuple[float, float]:
    """(exit → last rank of attempt 2 started, first → last start of attempt 2) for one gang."""
    from airflow_provider_sky.model.gang import RUNNING
    from airflow_provider_sky.node.runtime_retry import attempt_job_id
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.jobs import GangClient
    from airflow_provider_sky.watch.retry import RetryPolicy, watch_attempts

    client = GangClient(backend, handle)
    client.keep_secrets = True
    try:
        client.launch(task_from_args(num_nodes=n, run=RUN), job)
        policy = RetryPolicy.build(retries=1, retry_on_exit_codes=[1])

        async def go() -> Any:
            async for poll in watch_attempts(client, job, policy=policy, poll_interval=0.5, grace=3.0):
                if poll.attempt == 2 and all(r.state == RUNNING and r.start for r in poll.status.ranks):
                    return poll
                if poll.final:
                    raise RuntimeError(f"the gang ended without a running attempt 2: {poll.message()}")
            raise RuntimeError("the watch ended")

        poll = asyncio.run(asyncio.wait_for(go(), 120 + n))
        failed = next(r for r in poll.history[0]["ranks"] if r["rank"] == n - 1)
        starts = [r.start for r in poll.status.ranks]
        return max(starts) - float(failed["end"]), max(starts) - min(starts)
    finally:
        client.cancel(attempt_job_id(job, 2), grace=0.5)
        client.close()


def run(bench: Any, plan: Any, say: Callable[..., None]) -> list[Row]:
    reps = 1 if plan.quick else 3
    rows: list[Row] = []
    for n in plan.ns:
        total, skew = [], []
        for rep in range(reps):
            name = f"bench-retry-{n}-{rep}"
            backend, handle = bench.ssh_cluster(n, name)
            t, s = _one(backend, handle, n, f"retry-{n}-{rep}")
            backend.terminate(name, grace=0.5)
            say(
                f"  N={n}: exit -> every rank of attempt 2 running {t:.2f} s (attempt 2 start skew {s:.2f} s)"
            )
            total.append(t)
            skew.append(s)
        rows += [
            Row(
                "8 retry, SSH: failing rank's exit -> every rank of attempt 2 running",
                n,
                total,
                goal="< 5 s at 64" if n == 64 else "",
                met=(statistics.median(total) < 5.0) if n == 64 else None,
                note="grace 3 s, poll 0.5 s, no retry_delay; attempt 1's processes checked gone first",
            ),
            Row("8 retry: attempt 2 start skew first -> last rank", n, skew),
        ]
    return rows
