"""Run a gang's N rank triggers + the gang sensor's trigger the way Airflow's triggerer does."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any


def trigger_set(
    handle: dict[str, Any],
    job_id: str,
    n: int,
    *,
    sky_conn_id: str | None,
    poll_interval: float,
    grace: float = 3.0,
    distinct_streams: bool = False,
) -> list[Any]:
    """N SkyRankTrigger + 1 SkyGangTrigger with the operators' kwargs.

    ``distinct_streams`` gives every trigger its own stream key (a poll interval differing in the
    12th digit), i.e. N+1 independent pollers: the cost the shared stream avoids.
    """
    from airflow_provider_sky.triggers.gang import SkyGangTrigger, SkyRankTrigger

    def kw(i: int) -> dict[str, Any]:
        pi = poll_interval + (i * 1e-12 if distinct_streams else 0.0)
        return {
            "cluster": handle,
            "job_id": job_id,
            "sky_conn_id": sky_conn_id,
            "poll_interval": pi,
            "grace": grace,
        }

    out: list[Any] = [SkyRankTrigger(rank=r, **kw(r)) for r in range(n)]
    out.append(SkyGangTrigger(**kw(n)))
    return out


async def run_shared(
    triggers: list[Any],
    timeout: float,
    window: float | None = None,
    alongside: Callable[[], Coroutine[Any, Any, None]] | None = None,
) -> list[tuple[float, dict[str, Any]] | None]:
    """Subscribe every trigger to Airflow's SharedStreamManager; (wall time, payload) of each event.

    With ``window`` the triggers are stopped after that many seconds (None for those without an
    event), as the triggerer does when their tasks are gone. ``alongside`` runs as another task of
    the same loop once every trigger has subscribed.
    """
    from airflow.triggers.shared_stream import SharedStreamManager

    manager = SharedStreamManager()
    results: list[tuple[float, dict[str, Any]] | None] = [None] * len(triggers)

    async def one(i: int, trig: Any) -> None:
        key = trig.shared_stream_key()
        stream = manager.subscribe(trigger_id=i, trigger=trig, key=key)
        try:
            async for event in trig.filter_shared_stream(stream):
                results[i] = (time.time(), event.payload)
                return
        finally:
            await manager.unsubscribe(i, key)

    tasks = [asyncio.create_task(one(i, t)) for i, t in enumerate(triggers)]
    side: asyncio.Task[None] | None = asyncio.create_task(alongside()) if alongside is not None else None
    try:
        if window is not None:
            await asyncio.wait(tasks, timeout=window)
        else:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                raise TimeoutError(f"{len(pending)} of {len(tasks)} triggers fired no event in {timeout}s")
            for t in done:
                t.result()
        if side is not None:
            await side  # re-raises what went wrong there
    finally:
        for t in [*tasks, *([side] if side else [])]:
            t.cancel()
        await asyncio.gather(*tasks, *([side] if side else []), return_exceptions=True)
    return results
