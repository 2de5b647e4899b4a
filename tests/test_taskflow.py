"""``@task.sky`` (TaskFlow): a function returning the run command becomes a whole gang, run under ``dag.test()``."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pendulum
import pytest

from leaks import bridges, job_processes
from siblings import matching

REPO = Path(__file__).resolve().parent.parent


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


def _xcom(dr: Any, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(
            run_id=dr.run_id, key=key, task_ids=task_id, dag_ids=dr.dag_id, map_indexes=map_index
        )
        return XComModel.deserialize_value(session.scalars(query).one())


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


def test_example_builds_and_runs_the_whole_gang(sky_home: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """dags_examples/sky_taskflow.py: the upstream value and ``{{ run_id }}`` reach every rank's command."""
    dr, tis = _run("sky_taskflow")
    out = "".join(capfd.readouterr())
    assert str(dr.state) == "success"
    assert set(tis) == {
        "steps",
        "train.command",
        "train.cluster",
        "train.job",
        "train.gang",
        "train.down",
        *(f"train.rank[{i}]" for i in range(4)),
    }
    assert all(str(ti.state) == "success" for ti in tis.values()), {k: ti.state for k, ti in tis.items()}
    command = _xcom(dr, "train.command")
    assert command == (
        'echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES: 3 steps, '
        f'master $MASTER_ADDR:$MASTER_PORT, run {dr.run_id}"'
    )
    for rank in range(4):
        assert f"rank {rank} of 4: 3 steps, master 127.1.0.1:29512, run {dr.run_id}" in out
    assert "setup on node 3 of 4" in out
    assert not list((sky_home / "local").glob("sky-*")), "the teardown removed the cluster"


def test_a_failing_rank_fails_the_gang_fast(sky_home: Path) -> None:
    """The seed scenario through ``@task.sky``: rank 2 exits 1, the siblings are cancelled, the run fails."""
    started = time.monotonic()
    dr, tis = _run("sky_test_taskflow_fail", "tests/dags")
    took = time.monotonic() - started
    assert str(dr.state) == "failed"
    assert {i: str(tis[f"train.rank[{i}]"].state) for i in range(4)} == dict.fromkeys(range(4), "failed")
    cause = _xcom(dr, "train.rank", "sky_rank", 2)
    assert cause["state"] == "failed" and cause["exit_code"] == 1, cause
    others = [_xcom(dr, "train.rank", "sky_rank", i) for i in (0, 1, 3)]
    assert [o["state"] for o in others] == ["cancelled"] * 3, others
    assert max(float(o["end"]) for o in others) - float(cause["end"]) < 1.0, "siblings cancelled within 1 s"
    assert str(tis["train.gang"].state) == "failed"
    assert str(tis["train.down"].state) == "success"
    assert took < 90, f"the run took {took:.0f} s: the siblings' sleep 10000 was not cut short"
    assert not matching(f"SKY_PROVIDER_MARK={sky_home}/")
    assert not bridges(sky_home)


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
    """Issue 28.5: ``@task.sky(hang_timout=60)`` said ``Invalid arguments were passed to
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


def test_pipeline_example_hands_the_json_result_downstream(sky_home: Path) -> None:
    """dags_examples/sky_pipeline.py: rank 0's result.json reaches ``evaluate`` as a dict (the XComArg a
    ``@task.sky`` call returns), with the Params form's defaults for nodes, envs and resources."""
    dr, tis = _run("sky_pipeline")
    assert str(dr.state) == "success", {k: ti.state for k, ti in tis.items()}
    result = _xcom(dr, "train.gang")
    assert result == {"loss": 0.25, "nodes": 2, "checkpoint": f"ckpt/{dr.run_id}"}
    assert _xcom(dr, "evaluate") == 0.25
    assert {k for k in tis if k.startswith("train.rank")} == {"train.rank[0]", "train.rank[1]"}


def test_the_last_output_line_is_the_default_result_and_all_ranks_give_a_list(sky_home: Path) -> None:
    dr, tis = _run("sky_test_result_line", "tests/dags")
    assert str(dr.state) == "success", {k: ti.state for k, ti in tis.items()}
    # masked like the log: the nodes replaced the secret before the line reached the log
    assert _xcom(dr, "train.gang") == "rank 0 done, token ***"
    assert _xcom(dr, "every.gang") == ["r0", "r1"]
    assert _xcom(dr, "evaluate") == {"line": "rank 0 done, token ***", "lines": ["r0", "r1"]}


def test_a_result_file_is_masked_bounded_and_required(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dr, tis = _run("sky_test_result_file", "tests/dags")
    out = "".join(capfd.readouterr())
    assert str(tis["masked.gang"].state) == "success"
    assert _xcom(dr, "masked.gang") == "token=***"
    assert str(tis["big.gang"].state) == "failed"
    assert "more than result_max_bytes=1000 bytes" in out and "result_file (r.txt)" in out, out[-3000:]
    assert str(tis["missing.gang"].state) == "failed"
    assert "result_file ~/nowhere.json was not there" in out
    for group in ("big", "missing"):
        assert str(tis[f"{group}.rank[0]"].state) == "success"  # the gang ran: only its result is refused
        assert _xcoms(dr, f"{group}.gang") == []
    assert not list((sky_home / "local").glob("sky-*")), "the teardowns removed the clusters"


def _xcoms(dr: Any, task_id: str) -> list[Any]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(run_id=dr.run_id, key="return_value", task_ids=task_id, dag_ids=dr.dag_id)
        return list(session.scalars(query))
