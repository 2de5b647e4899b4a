"""The triggers on real local ranks: one shared poll per gang (O(N) calls), live logs, on_kill, events."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.triggers.shared_stream import SharedStreamManager
from gangs import launched, trigger_kwargs
from leaks import job_processes, processes_under

from airflow_provider_sky.runners.base import CALLS
from airflow_provider_sky.triggers.gang import SkyGangTrigger, SkyRankTrigger
from airflow_provider_sky.watch.jobs import GangClient


async def _shared(triggers: list[Any]) -> list[Any]:
    """Run triggers the way Airflow's triggerer does when they share a stream key."""
    manager = SharedStreamManager()

    async def one(i: int, trig: Any) -> Any:
        key = trig.shared_stream_key()
        stream = manager.subscribe(trigger_id=i, trigger=trig, key=key)
        try:
            async for event in trig.filter_shared_stream(stream):
                return event.payload
        finally:
            await manager.unsubscribe(i, key)

    return await asyncio.gather(*(one(i, t) for i, t in enumerate(triggers)))


@pytest.mark.parametrize("n", [4, 16])
def test_watching_n_ranks_costs_n_calls_per_poll(sky_home: Path, n: int) -> None:
    b, handle = launched(sky_home, n, "sleep 2")
    triggers: list[Any] = [SkyRankTrigger(rank=r, **trigger_kwargs(handle)) for r in range(n)]
    triggers.append(SkyGangTrigger(**trigger_kwargs(handle)))
    keys = {t.shared_stream_key() for t in triggers}
    assert len(keys) == 1  # every trigger of the gang joins the same poll
    CALLS.reset()
    t0 = time.monotonic()
    events = asyncio.run(_shared(triggers))
    elapsed = time.monotonic() - t0
    polls = elapsed / 0.2 + 2
    calls = CALLS.total()
    # one status call per node per poll, plus a few log reads; never N per trigger (N²)
    assert calls <= n * polls + 3 * n, (calls, polls)
    assert calls < n * n * polls / 2
    assert [e["state"] for e in events[:n]] == ["succeeded"] * n
    assert events[n]["state"] == "succeeded"
    b.terminate("c")


def test_rank_trigger_streams_the_log_and_reports_root_cause(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    run = 'echo "hello from $SKYPILOT_NODE_RANK"; if [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 0.5; exit 139; fi; sleep 10000'
    b, handle = launched(sky_home, 3, run)
    triggers: list[Any] = [SkyRankTrigger(rank=r, **trigger_kwargs(handle)) for r in range(3)] + [
        SkyGangTrigger(**trigger_kwargs(handle))
    ]
    events = asyncio.run(_shared(triggers))
    text = "".join(capfd.readouterr())
    assert [e["state"] for e in events[:3]] == ["cancelled", "failed", "cancelled"]
    assert events[1]["reason"] == "segmentation fault (SIGSEGV)"
    for e in (events[0], events[2], events[3]):
        assert "rank 1 (127.1.0.2) exited with code 139: segmentation fault (SIGSEGV)" in e["message"]
    assert events[3]["state"] == "failed"
    for r in range(3):
        assert f"hello from {r}" in text
    assert not [p for p in processes_under(sky_home) if "sleep" in p[1]]
    b.terminate("c")


def test_standalone_run_is_the_dag_test_path(sky_home: Path) -> None:
    b, handle = launched(sky_home, 2, 'echo "r$SKYPILOT_NODE_RANK"; exit $SKYPILOT_NODE_RANK')

    async def first(trig: Any) -> Any:
        async for ev in trig.run():
            return ev.payload

    ev0 = asyncio.run(first(SkyRankTrigger(rank=0, **trigger_kwargs(handle))))
    ev1 = asyncio.run(first(SkyRankTrigger(rank=1, **trigger_kwargs(handle))))
    gang = asyncio.run(first(SkyGangTrigger(**trigger_kwargs(handle))))
    assert ev1["state"] == "failed" and ev1["exit_code"] == 1
    assert ev0["state"] in ("succeeded", "cancelled")
    assert gang["state"] == "failed"
    b.terminate("c")


def test_on_kill_cancels_the_gang(sky_home: Path) -> None:
    b, handle = launched(sky_home, 3, "sleep 10000")
    trig = SkyRankTrigger(rank=0, **trigger_kwargs(handle))
    asyncio.run(trig.on_kill())
    poll = GangClient(b, b.find("c")).poll("job")  # type: ignore[arg-type]
    assert [r.state for r in poll.status.ranks] == ["cancelled"] * 3
    assert not job_processes(sky_home) or all("sleep" not in p[1] for p in processes_under(sky_home))
    b.terminate("c")


def test_triggers_serialize_round_trip(sky_home: Path) -> None:
    b, handle = launched(sky_home, 1, "true")
    for trig in (SkyRankTrigger(rank=0, **trigger_kwargs(handle)), SkyGangTrigger(**trigger_kwargs(handle))):
        path, kwargs = trig.serialize()
        module, name = path.rsplit(".", 1)
        cls = getattr(__import__(module, fromlist=[name]), name)
        again = cls(**kwargs)
        assert again.serialize() == (path, kwargs)
        assert again.shared_stream_key() == trig.shared_stream_key()
    b.terminate("c")


def test_a_held_event_waits_for_fire_after_but_the_fail_fast_cancel_does_not(sky_home: Path) -> None:
    """``fire_after`` (the Airflow 3.3 defer race workaround) delays the events, never the cancel."""
    run = 'if [ "$SKYPILOT_NODE_RANK" = "1" ]; then exit 3; fi; sleep 10000'
    b, handle = launched(sky_home, 3, run)
    fire_after = time.time() + 3.0
    triggers: list[Any] = [
        SkyRankTrigger(rank=r, **trigger_kwargs(handle, fire_after=fire_after)) for r in range(3)
    ]
    triggers.append(SkyGangTrigger(**trigger_kwargs(handle, fire_after=fire_after)))
    assert triggers[0].serialize()[1]["fire_after"] == fire_after  # survives a triggerer restart
    started = time.time()

    async def watch_siblings() -> float:
        while processes_under(sky_home / "local" / "c"):
            await asyncio.sleep(0.05)
        return time.time()

    async def both() -> tuple[list[Any], float]:
        siblings_gone = asyncio.ensure_future(watch_siblings())
        events = await _shared(triggers)
        return events, await siblings_gone

    events, gone = asyncio.run(both())
    assert gone - started < 2.5, "the cancel waited for the hold"
    assert time.time() >= fire_after
    assert [e["state"] for e in events[:3]] == ["cancelled", "failed", "cancelled"]
    assert events[3]["state"] == "failed" and "exited with code 3" in events[3]["message"]
    b.terminate("c")
