"""``@task.sky`` (TaskFlow): a function returning the run command becomes a whole gang, run under ``dag.test()``."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pendulum
import pytest
from leaks import job_processes

REPO = Path(__file__).resolve().parents[2]


def _load(name: str, folder: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"taskflow_{name}", REPO / folder / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(name: str, folder: str = "dags_examples") -> tuple[Any, dict[str, Any]]:
    dr = _load(name, folder).dag.test()
    return dr, {
        f"{ti.task_id}[{ti.map_index}]" if ti.map_index >= 0 else ti.task_id: ti
        for ti in dr.get_task_instances()
    }


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def test_registered_as_task_sky() -> None:
    """``task.sky`` resolves through the provider info, as ``task.docker`` does for the Docker provider."""
    from airflow.sdk import task
    from airflow.sdk.providers_manager_runtime import ProvidersManagerTaskRuntime

    from airflow_provider_sky import get_provider_info
    from airflow_provider_sky.decorators.sky import sky_task

    assert {
        "name": "sky",
        "class-name": "airflow_provider_sky.decorators.sky.sky_task",
    } in get_provider_info()["task-decorators"]
    assert ProvidersManagerTaskRuntime().taskflow_decorators["sky"] is sky_task
    assert task.sky is sky_task


def test_a_function_returning_no_command_fails_before_provisioning(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dr, tis = _run("sky_test_taskflow_bad", "tests/dags")
    out = "".join(capfd.readouterr())
    assert str(dr.state) == "failed"
    assert str(tis["train.command"].state) == "failed"
    assert "run: the @task.sky function train() must return the shell command every node runs" in out, out[
        -3000:
    ]
    assert "it returned '   '" in out
    for task_id in ("train.cluster", "train.job", "train.gang", "train.down"):
        assert str(tis[task_id].state) == "upstream_failed", (task_id, tis[task_id].state)
    assert "provisioned-and-set-up" not in out
    assert not (sky_home / "local").exists() or not list((sky_home / "local").glob("sky-*"))
    assert not job_processes(sky_home)


def test_bad_input_names_the_field_at_dag_parse_time() -> None:
    from airflow.sdk import DAG, task

    from airflow_provider_sky.spec import SpecError

    def cmd() -> str:
        return "true"

    with DAG("bad_taskflow", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        with pytest.raises(SpecError, match="^num_nodes: "):
            task.sky(num_nodes=0)(cmd)()
        with pytest.raises(SpecError, match="RANK"):
            task.sky(num_nodes=2, envs={"RANK": "3"})(cmd)()
        with pytest.raises(SpecError, match="^resources"):
            task.sky(num_nodes=2, resources={"cpus": "many"})(cmd)()
        with pytest.raises(TypeError, match="run is what the decorated function returns"):
            task.sky(num_nodes=2, run="echo hi")(cmd)
        with pytest.raises(TypeError, match="keyword arguments only"):
            task.sky("not a function")
        with pytest.raises(TypeError, match="missing a required argument: 'steps'"):

            @task.sky(num_nodes=2)
            def needs(steps: int) -> str:
                return f"echo {steps}"

            needs()


def test_calling_twice_and_override_make_distinct_gangs() -> None:
    from airflow.sdk import DAG, task

    @task.sky(num_nodes=2)
    def step() -> str:
        return "true"

    with DAG("twice", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")) as dag:
        first = step()
        second = step()
        third = step.override(group_id="eval", num_nodes=3)()
        first >> second >> third
    assert [g.group_id for g in (first, second, third)] == ["step", "step__1", "eval"]
    assert dag.get_task("eval.job").spec_overrides["num_nodes"] == 3
    assert (
        dag.get_task("step__1.job").spec_overrides["run"] == "{{ ti.xcom_pull(task_ids='step__1.command') }}"
    )
    # a group's leaves are its rank and gang tasks (Airflow leaves teardowns out); its root the command task
    assert dag.get_task("step__1.command").upstream_task_ids == {"step.rank", "step.gang"}
    assert dag.get_task("step__1.cluster").upstream_task_ids == {"step__1.command"}


def test_a_mistyped_argument_is_named_with_the_nearest_valid_one() -> None:
    """``@task.sky(hang_timout=60)`` said ``Invalid arguments were passed to
    SkyClusterOperator (task_id: cluster)``: neither the decorator nor the nearest valid name."""
    from airflow.sdk import DAG, task

    def cmd() -> str:
        return "true"

    with DAG("typo_taskflow", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        with pytest.raises(TypeError) as info:
            task.sky(num_nodes=2, hang_timout=60)(cmd)
        assert str(info.value) == "@task.sky: unknown argument 'hang_timout'; did you mean 'hang_timeout'?"
        with pytest.raises(
            TypeError, match="^@task.sky: unknown argument 'num_node'; did you mean 'num_nodes'"
        ):
            task.sky(num_nodes=2)(cmd).override(num_node=3)
