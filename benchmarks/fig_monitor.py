"""Figure 3: monitoring cost. Remote calls per poll interval to watch one gang of N ``sleep`` ranks.

All N rank triggers plus the gang sensor's trigger run under SharedStreamManager for a fixed window;
``runners.base.CALLS`` counts every remote call (status polls, log reads, the secrets read when the
shared stream opens). Calls / (window / poll_interval) is the figure: one status call per node per
poll means N, independent pollers would cost N per trigger, N×N.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from benchmarks.common import kill_job_processes
from benchmarks.triggers import run_shared, trigger_set

_ids = itertools.count()


def one_window(
    backend: Any,
    handle: Any,
    n: int,
    *,
    sky_conn_id: str | None,
    poll_interval: float,
    window: float,
    distinct_streams: bool = False,
) -> tuple[float, int, int]:
    """(calls per poll interval, calls, status polls made) over ``window`` seconds of watching."""
    from airflow_provider_sky.runners.base import CALLS
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.jobs import GangClient

    job_id = f"mon{n}-{next(_ids)}-{int(time.time() * 1000) % 10**8}"
    spec = task_from_args(num_nodes=n, run="sleep 10000")
    client = GangClient(backend, handle)
    polls = 0
    original = GangClient.apoll

    async def counting_apoll(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal polls
        if kwargs.get("ranks") is None and (len(args) < 4 or args[3] is None):
            polls += 1  # a full status poll (a log read asks for one rank)
        return await original(self, *args, **kwargs)

    try:
        client.launch(spec, job_id)
        triggers = trigger_set(
            handle.to_dict(),
            job_id,
            n,
            sky_conn_id=sky_conn_id,
            poll_interval=poll_interval,
            distinct_streams=distinct_streams,
        )
        GangClient.apoll = counting_apoll  # type: ignore[method-assign]
        CALLS.reset()
        results = asyncio.run(run_shared(triggers, timeout=window + 30, window=window))
        calls = CALLS.total()
        if any(r is not None for r in results):
            raise RuntimeError("a trigger fired while the ranks should still be sleeping")
        return calls / (window / poll_interval), calls, polls
    finally:
        GangClient.apoll = original  # type: ignore[method-assign]
        client.cancel(job_id, grace=1.0)
        kill_job_processes(job_id)
        client.close()
