"""`make bench` parses the benchmark DAG folders in a real stack; they must load, with the shapes the
figures compare (figure 4's floor is sky_gang's shape with tasks that do nothing)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.dag_processing.dagbag import DagBag
from airflow.sdk.module_loading import import_string

DAGS = Path(__file__).resolve().parents[2] / "benchmarks" / "dags"


def _bag(folder: Path, monkeypatch: pytest.MonkeyPatch) -> DagBag:
    monkeypatch.syspath_prepend(str(folder))  # as Airflow puts the dags folder on sys.path
    bag = DagBag(dag_folder=str(folder), safe_mode=False)
    assert bag.import_errors == {}, bag.import_errors
    return bag


def test_figure_4_dags_load_and_the_floor_has_sky_gangs_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    bag = _bag(DAGS, monkeypatch)
    assert {"bench_sky_true", "bench_ssh_true", "bench_floor_true", "bench_floor_three_hops"} <= set(
        bag.dag_ids
    )
    sky, floor = bag.dags["bench_sky_true"], bag.dags["bench_floor_true"]
    assert _edges(floor) == _edges(sky)  # the same tasks and hand-offs as the gang it is the floor of
    for dag in (sky, floor):
        for task_id in ("gang.rank", "gang.gang"):  # watched from the triggerer, never a worker
            assert dag.get_task(task_id).start_from_trigger is True, (dag.dag_id, task_id)
    three = bag.dags["bench_floor_three_hops"]
    assert {t.task_id for t in three.tasks} == {"gang.job", "gang.rank", "gang.gang", "gang.down"}


def test_figure_5_dags_load_for_the_sizes_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_SCALE_NS", "16,64")
    bag = _bag(DAGS / "scale", monkeypatch)
    assert {"bench_scale_16", "bench_scale_fail_64", "bench_scale_warmup"} <= set(bag.dag_ids)
    for n in (16, 64):
        sky, floor = bag.dags[f"bench_scale_{n}"], bag.dags[f"bench_scale_floor_{n}"]
        assert _edges(floor) == _edges(sky), n  # figure 5's floor: the gang's shape, no provider work
        for task_id in ("gang.rank", "gang.gang"):
            assert floor.get_task(task_id).start_from_trigger is True, (n, task_id)


def _edges(dag: Any) -> set[tuple[str, str]]:
    return {(up, t.task_id) for t in dag.tasks for up in t.upstream_task_ids}


def test_the_floor_trigger_fires_once_its_runs_moment_is_past(tmp_path: Path) -> None:
    """Figure 5's floor ranks end when the moment their job task left is past, not before, and push
    a sky_rank as the provider's rank tasks do."""
    from benchmarks.floor import FloorWaitTrigger, moment_file

    class TI:
        map_index = 7

    trigger = FloorWaitTrigger(folder=str(tmp_path), poll=0.05, xcom=True)
    trigger.render_template_fields({"run_id": "manual__2026/x", "ti": TI()})
    assert trigger.rank == 7
    moment = time.time() + 0.5
    moment_file(str(tmp_path), "manual__2026/x").write_text(repr(moment))
    classpath, kwargs = trigger.serialize()

    async def first() -> Any:
        async for event in import_string(classpath)(**kwargs).run():
            return event

    event = asyncio.run(first())
    assert time.time() >= moment
    assert event.task_instance_state == "success"
    assert event.xcoms["sky_rank"]["rank"] == 7 and event.xcoms["sky_rank"]["end"] == moment


def test_the_kill_floor_ends_every_group_it_starts(tmp_path: Path) -> None:
    from benchmarks import kill_floor

    last, median = kill_floor.once(tmp_path / "kf", 8)
    assert 0 <= median <= last < 10
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if _reads(p, kill_floor.RANK_CMD)]
    assert left == []


def _reads(path: Path, text: str) -> bool:
    try:
        return text.encode() in path.read_bytes()
    except OSError:
        return False
