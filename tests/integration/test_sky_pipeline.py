"""A SkyPilot pipeline file as gangs one after another (sky_pipeline), under dag.test() on the local backend."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_sky.spec import SpecError, load_task_yaml
from airflow_provider_sky.spec.yamlfile import load_pipeline_yaml
from unit.test_sky_pipeline import DAGS, PIPELINE

#: dag.test() needs the metadata DB (migrated once per session), whichever module runs first
pytestmark = pytest.mark.usefixtures("airflow_db")


def _module() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("sky_test_sky_pipeline", DAGS / "sky_test_sky_pipeline.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(dag_id: str) -> tuple[Any, dict[tuple[str, int], Any]]:
    dr = getattr(_module(), dag_id).test()
    return dr, {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}


def test_the_pipeline_loads_each_task_beside_the_file() -> None:
    name, tasks = load_pipeline_yaml(PIPELINE)
    assert name == "two-steps" and [t["name"] for t in tasks] == ["prep", "train"]
    assert tasks[0]["workdir"] == str(DAGS / "sky_test_sky_pipeline_code")
    with pytest.raises(SpecError, match=r"sky_pipeline\("):  # the single-task loader says what to use
        load_task_yaml(PIPELINE)


def test_each_task_has_its_own_cluster() -> None:
    """The DAG's default cluster is one per run: a second gang there would meet the first one's cluster
    (of another size) when it starts before the first one's teardown ran (dag.test's order did that)."""
    dag = _module().sky_test_pipeline_ok
    names = {t: dag.get_task(f"two-steps.{t}.cluster").cluster_name for t in ("prep", "train")}
    assert names["prep"] != names["train"]
    assert dag.get_task("two-steps.train.down").cluster_name == names["train"]


def test_the_second_task_runs_after_the_first_succeeded() -> None:
    dr, tis = _run("sky_test_pipeline_ok")
    assert str(dr.state) == "success"
    assert tis[("two-steps.prep.gang", -1)].state == "success"
    assert tis[("two-steps.train.gang", -1)].state == "success"
    assert tis[("two-steps.train.down", -1)].state == "success"


def test_a_failing_first_task_stops_the_pipeline() -> None:
    dr, tis = _run("sky_test_pipeline_stops")
    assert str(dr.state) == "failed"
    assert tis[("two-steps.prep.gang", -1)].state == "failed"
    assert tis[("two-steps.prep.down", -1)].state == "success"  # its cluster is torn down
    assert tis[("two-steps.train.cluster", -1)].state == "upstream_failed"  # nothing of it was made
