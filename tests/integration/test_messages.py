"""What the rank tasks say, on real local ranks: one picture of a failure, and who cancelled a gang."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from airflow.executors.workloads import TaskInstance
from airflow.triggers.shared_stream import SharedStreamManager
from gangs import launched, local_gang, trigger_kwargs

from airflow_provider_sky.triggers.gang import SkyGangTrigger, SkyRankTrigger


async def _subscribe(manager: SharedStreamManager, i: int, trig: Any) -> dict[str, Any]:
    """One trigger, subscribed the way Airflow's triggerer does it; its first event."""
    key = trig.shared_stream_key()
    stream = manager.subscribe(trigger_id=i, trigger=trig, key=key)
    try:
        async for event in trig.filter_shared_stream(stream):
            return dict(event.payload)
        raise AssertionError("no event")
    finally:
        await manager.unsubscribe(i, key)


def test_every_rank_task_tells_the_same_failure(sky_home: Path) -> None:
    """The failing rank's own message lists its siblings as cancelled, like theirs (not running / None)."""
    b, handle = launched(
        sky_home, 4, 'if [ "$SKYPILOT_NODE_RANK" = 2 ]; then sleep 0.5; exit 1; fi; sleep 10000'
    )
    ip2 = handle["nodes"][2]["ip"]
    triggers: list[Any] = [SkyRankTrigger(rank=r, **trigger_kwargs(handle)) for r in range(4)]
    triggers.append(SkyGangTrigger(**trigger_kwargs(handle)))

    async def run() -> list[dict[str, Any]]:
        manager = SharedStreamManager()
        return await asyncio.gather(*(_subscribe(manager, i, t) for i, t in enumerate(triggers)))

    events = asyncio.run(run())
    assert [e["state"] for e in events] == ["cancelled", "cancelled", "failed", "cancelled", "failed"]
    picture = (
        f"Job job failed: rank 2 ({ip2}) exited with code 1; ranks 0, 1, 3 cancelled. "
        "Return code list: ['cancelled', 'cancelled', 1, 'cancelled']"
    )
    for e in events:
        assert picture in e["message"], e["message"]
    assert events[2]["message"] == picture
    b.terminate("c")


def test_a_wide_gang_tells_its_failure_in_a_short_line(sky_home: Path) -> None:
    """100 real ranks, rank 50 fails: each rank task's message names runs of ranks and sums the return
    codes, instead of listing 100 ranks and 100 codes (18 KB per rank task at 1,024 ranks)."""
    b, handle = launched(
        sky_home, 100, 'if [ "$SKYPILOT_NODE_RANK" = 50 ]; then sleep 1; exit 1; fi; sleep 10000'
    )
    ip = handle["nodes"][50]["ip"]
    triggers: list[Any] = [SkyRankTrigger(rank=r, **trigger_kwargs(handle)) for r in (0, 50, 99)]

    async def run() -> list[dict[str, Any]]:
        manager = SharedStreamManager()
        return await asyncio.gather(*(_subscribe(manager, i, t) for i, t in enumerate(triggers)))

    events = asyncio.run(run())
    picture = (
        f"Job job failed: rank 50 ({ip}) exited with code 1; ranks 0-49, 51-99 cancelled. "
        "Return codes of the 100 ranks: 'cancelled' x99, 1 x1"
    )
    assert [e["state"] for e in events] == ["cancelled", "failed", "cancelled"]
    for e in events:
        assert picture in e["message"] and len(e["message"]) < 400, e["message"]
    b.terminate("c")


def _marked(sky_home: Path, ti: TaskInstance | None) -> list[dict[str, Any]]:
    """Three ranks run; a user acts on rank 1's deferred task: its trigger's on_kill, then it is removed."""
    b, handle = launched(sky_home, 3, "sleep 10000")
    triggers: list[Any] = [SkyRankTrigger(rank=r, **trigger_kwargs(handle)) for r in range(3)]
    triggers.append(SkyGangTrigger(**trigger_kwargs(handle)))
    if ti is not None:
        triggers[1].task_instance = ti  # what the triggerer sets on a trigger it runs for a task

    async def run() -> list[dict[str, Any]]:
        manager = SharedStreamManager()
        watchers = {i: asyncio.ensure_future(_subscribe(manager, i, t)) for i, t in enumerate(triggers)}
        await asyncio.sleep(1.0)  # every trigger is watching
        watchers.pop(1).cancel()  # the triggerer cancels the marked task's trigger, then calls on_kill
        await triggers[1].on_kill()
        return [await w for w in watchers.values()]

    events = asyncio.run(run())
    b.terminate("c")
    return events


def test_a_mark_failed_cancel_names_the_task_and_the_user(sky_home: Path) -> None:
    ti = TaskInstance(
        id=uuid.uuid4(),
        dag_version_id=uuid.uuid4(),
        dag_id="train",
        task_id="gang.rank",
        run_id="manual__2026-12-03T05:00:00+00:00",
        try_number=1,
        map_index=1,
        pool_slots=1,
        priority_weight=1,
    )
    events = _marked(sky_home, ti)
    who = (
        "rank task gang.rank [rank 1] of DAG train, run manual__2026-12-03T05:00:00+00:00, "
        "was marked failed, marked success or cleared by a user"
    )
    assert [e["state"] for e in events] == ["cancelled", "cancelled", "cancelled"]
    for e in events:
        assert f"Job job was cancelled from Airflow: {who}" in e["message"], e["message"]
    assert events[0]["message"].startswith("rank 0 (")
    assert events[0]["reason"] == f"cancelled: {who}"


def test_a_cancel_by_a_trigger_without_its_task_still_says_a_user_did_it(sky_home: Path) -> None:
    events = _marked(sky_home, None)
    for e in events:
        assert (
            "Job job was cancelled from Airflow: the task watching rank 1 was marked failed, "
            "marked success or cleared by a user" in e["message"]
        ), e["message"]


def test_a_gang_without_retries_says_nothing_of_retrying(sky_home: Path, caplog: Any) -> None:
    """With no retries configured the gang log said ``rank 2 exited 1, not retryable (not in
    retry_on_exit_codes)``, about a setting the user never touched. With retries it still says why."""
    import logging

    from airflow_provider_sky.watch.retry import RetryPolicy, watch_attempts

    run = 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 3; fi; sleep 10000'

    def failed(policy: RetryPolicy | None, name: str) -> str:
        b, client, task = local_gang(sky_home, 2, run, name=name)
        client.launch(task, "job")

        async def go() -> None:
            async for _ in watch_attempts(client, "job", policy=policy, poll_interval=0.1, grace=1.0):
                pass

        caplog.clear()
        with caplog.at_level(logging.INFO, logger="airflow_provider_sky"):
            asyncio.run(asyncio.wait_for(go(), 30))
        b.terminate(name)
        return "\n".join(caplog.messages)

    quiet = failed(None, "a")
    assert "retry" not in quiet and "retryable" not in quiet, quiet
    told = failed(RetryPolicy.build(1, 0.0, False, [4]), "b")
    assert "rank 1 exited 3, not retryable (not in retry_on_exit_codes)" in told, told


def test_the_failure_says_the_failing_ranks_last_output_lines_masked(sky_home: Path) -> None:
    """The root cause said only ``exited with code 3``; the rank's own last lines (``CUDA
    error: an illegal memory access``) were in its log only. Now every rank task's message and the gang
    sensor's carry them, the failing rank's short headline its last line; a secret stays masked."""
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = 2 ]; then for i in 1 2 3 4 5 6 7 8; do echo "step $i"; done; '
        'echo "token is $HF_TOKEN"; echo "CUDA error: an illegal memory access"; sleep 0.3; exit 3; fi; '
        "sleep 10000"
    )
    b, handle = launched(sky_home, 3, run, secrets={"HF_TOKEN": "hf_s3cr3t_value"})
    triggers: list[Any] = [SkyRankTrigger(rank=r, **trigger_kwargs(handle)) for r in range(3)]
    triggers.append(SkyGangTrigger(**trigger_kwargs(handle)))

    async def go() -> list[dict[str, Any]]:
        manager = SharedStreamManager()
        return await asyncio.gather(*(_subscribe(manager, i, t) for i, t in enumerate(triggers)))

    events = asyncio.run(go())
    assert [e["state"] for e in events] == ["cancelled", "cancelled", "failed", "failed"]
    for e in events:
        message = e["message"]
        assert "rank 2" in message and "exited with code 3" in message, message
        assert "CUDA error: an illegal memory access" in message and "step 8" in message, message
        assert "step 1" not in message, message  # the last few lines, not the whole log
        assert "hf_s3cr3t_value" not in message, message
    assert "CUDA error: an illegal memory access" in events[2]["headline"], events[2]["headline"]
    assert "rank 2" in events[0]["headline"] and "CUDA error" in events[0]["headline"], events[0]["headline"]
    b.terminate("c")
