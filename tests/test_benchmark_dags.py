"""`make bench` parses the benchmark DAG folders in a real stack; they must load, with the shapes the
figures compare (figure 4's floor is sky_gang's shape with tasks that do nothing)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from airflow.dag_processing.dagbag import DagBag

DAGS = Path(__file__).resolve().parent.parent / "benchmarks" / "dags"


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

    def edges(dag: Any) -> set[tuple[str, str]]:
        return {(up, t.task_id) for t in dag.tasks for up in t.upstream_task_ids}

    assert edges(floor) == edges(sky)  # the same tasks and hand-offs as the gang it is the floor of
    for dag in (sky, floor):
        for task_id in ("gang.rank", "gang.gang"):  # watched from the triggerer, never a worker
            assert dag.get_task(task_id).start_from_trigger is True, (dag.dag_id, task_id)
    three = bag.dags["bench_floor_three_hops"]
    assert {t.task_id for t in three.tasks} == {"gang.job", "gang.rank", "gang.gang", "gang.down"}


def test_figure_5_dags_load_for_the_sizes_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BENCH_SCALE_NS", "16,64")
    bag = _bag(DAGS / "scale", monkeypatch)
    assert {"bench_scale_16", "bench_scale_fail_64", "bench_scale_warmup"} <= set(bag.dag_ids)
