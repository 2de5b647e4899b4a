"""The pipeline parts without a process: result parsing and bounds, templated task fields (Params),
where a gang's outlets and result live in the DAG. Seconds."""

from __future__ import annotations

import pendulum
import pytest
from airflow.sdk import DAG, Asset, task

from airflow_provider_sky.operators._params import coerce_rendered, name_param, parse_time, templated
from airflow_provider_sky.operators.job import SkyJobOperator
from airflow_provider_sky.spec import SpecError, task_from_args
from airflow_provider_sky.taskgroup import sky_gang
from airflow_provider_sky.watch.result import MAX_BYTES_LIMIT, check_result_args, decode_file, last_line


def _dag(name: str) -> DAG:
    return DAG(name, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"))


def test_last_line_is_the_last_non_blank_line_right_stripped() -> None:
    assert last_line(b"a\nloss 0.25  \n\n  \n", complete=True) == "loss 0.25"
    assert last_line(b"a\r\nb\r\n", complete=True) == "b"
    assert last_line(b"\n \n", complete=True) is None
    assert last_line(b"", complete=True) is None
    assert last_line(b"only", complete=True) == "only"
    with pytest.raises(ValueError):  # the read began inside the line: it is longer than the bound
        last_line(b"xxxxxxxx", complete=False)


def test_a_result_file_is_json_when_it_parses() -> None:
    assert decode_file(b'{"loss": 0.25}\n') == {"loss": 0.25}
    assert decode_file(b"[1, 2]") == [1, 2]
    assert decode_file(b"s3://bucket/ckpt\n") == "s3://bucket/ckpt"
    assert decode_file(b"not json {") == "not json {"


def test_result_arguments_are_checked_at_parse_time() -> None:
    assert check_result_args("all", 10) == ("all", 10)
    assert check_result_args(2, MAX_BYTES_LIMIT) == (2, MAX_BYTES_LIMIT)
    with pytest.raises(ValueError, match="^result_ranks: "):
        check_result_args("first", 10)
    with pytest.raises(ValueError, match="^result_max_bytes: .*result_file"):
        check_result_args(0, MAX_BYTES_LIMIT + 1)
    with _dag("bad_result"), pytest.raises(ValueError, match="^result_ranks: "):
        sky_gang(num_nodes=2, run="true", result_ranks=-1)


def test_result_file_is_a_task_field_of_one_line() -> None:
    assert task_from_args(run="true", result_file="~/out/r.json").result_file == "~/out/r.json"
    assert task_from_args(run="true", result_file="~/r").to_dict()["result_file"] == "~/r"
    with pytest.raises(SpecError, match="^result_file: .*(one line|control character)"):
        task_from_args(run="true", result_file="a\nb")
    with pytest.raises(SpecError, match="^result_file: must be a non-empty string"):
        task_from_args(run="true", result_file=3)


def test_templated_fields_wait_for_the_run_and_then_must_be_valid() -> None:
    given = {"num_nodes": "{{ params.num_nodes }}", "envs": "{{ params['envs'] }}", "run": "echo {{ ds }}"}
    templates = templated(given)
    assert set(templates) == {"num_nodes", "envs"}  # run is a command: Jinja in it stays text
    assert parse_time(given) == {"run": "echo {{ ds }}"}
    rendered = {"num_nodes": "3", "envs": "{'LR': '0.5'}", "run": "echo 2026-01-01"}
    assert coerce_rendered(rendered, templates) == {
        "num_nodes": 3,
        "envs": {"LR": "0.5"},
        "run": "echo 2026-01-01",
    }
    assert coerce_rendered({**rendered, "envs": '{"LR": "0.5"}'}, templates)["envs"] == {"LR": "0.5"}
    with pytest.raises(SpecError, match=r"^num_nodes: params\.num_nodes gave 'three', not a whole number"):
        coerce_rendered({**rendered, "num_nodes": "three"}, templates)
    with pytest.raises(SpecError, match=r"^envs: params\.envs gave .*not a mapping.*nothing was provisioned"):
        coerce_rendered({**rendered, "envs": "[1]"}, templates)
    named = name_param(SpecError("num_nodes", "must be at least 1, got 0"), templates)
    assert str(named) == (
        "num_nodes: must be at least 1, got 0 (the value came from params.num_nodes; nothing was provisioned)"
    )


def test_an_operator_with_templated_fields_parses_and_renders_them() -> None:
    with _dag("params_form"):
        job = SkyJobOperator(
            task_id="job", cluster={}, run="true", num_nodes="{{ params.n }}", resources="{{ params.r }}"
        )
    job.spec_overrides = {**job.spec_overrides, "num_nodes": "4", "resources": "{'cpus': '2+'}"}
    spec = job.rendered_spec()
    assert spec.num_nodes == 4 and spec.resources.cpus == "2+"
    job.spec_overrides = {**job.spec_overrides, "resources": "{'cpus': 'many'}"}
    with pytest.raises(SpecError, match=r"^resources\.cpus: .*\(the value came from params\.r;"):
        job.rendered_spec()


def test_outlets_go_to_the_gang_sensor_and_result_is_its_xcom() -> None:
    ckpt = Asset("s3://ckpt/run")
    with _dag("outlets") as dag:
        gang = sky_gang("train", num_nodes=2, run="true", outlets=[ckpt], inlets=[Asset("s3://data")])
    assert dag.get_task("train.gang").outlets == [ckpt]
    assert dag.get_task("train.job").inlets == [Asset("s3://data")]
    assert not dag.get_task("train.job").outlets and not dag.get_task("train.cluster").outlets
    assert gang.result.operator is dag.get_task("train.gang")
    with _dag("outlets_on_job"), pytest.raises(ValueError, match="^outlets: task job ends before the gang"):
        SkyJobOperator(task_id="job", cluster={}, run="true", outlets=[ckpt])


def test_a_task_sky_call_is_its_result_and_its_dependencies_are_the_gangs() -> None:
    @task
    def prepare() -> int:
        return 1

    @task.sky(num_nodes=2)
    def train(n: int) -> str:
        return f"echo {n}"

    @task
    def evaluate(result: str) -> str:
        return result

    with _dag("taskflow_result") as dag:
        first = prepare.override(task_id="first")()
        trained = train(prepare())
        evaluate(trained)
        first >> trained
    assert trained.operator is dag.get_task("train.gang") and trained.key == "return_value"
    assert dag.get_task("evaluate").upstream_task_ids == {"train.gang"}
    # ``first >> train(...)`` waits before the gang starts, not before its sensor
    assert dag.get_task("train.command").upstream_task_ids == {"prepare", "first"}
    assert "first" not in dag.get_task("train.gang").upstream_task_ids
