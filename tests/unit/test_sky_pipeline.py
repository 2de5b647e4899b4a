"""A SkyPilot pipeline file as gangs one after another (sky_pipeline), under dag.test() on the local backend."""

from __future__ import annotations

from pathlib import Path

import pendulum
import pytest
from airflow.sdk import DAG

from airflow_provider_sky.operators.jobgroup import STOP_ENV, stop_path
from airflow_provider_sky.pipeline import JOBGROUP_ENV, sky_job_group
from airflow_provider_sky.spec import SpecError, load_task_yaml
from airflow_provider_sky.spec.yamlfile import load_job_group_yaml, load_pipeline_yaml

DAGS = Path(__file__).resolve().parents[1] / "dags"
PIPELINE = DAGS / "sky_test_sky_pipeline.yaml"


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def test_a_job_group_is_not_a_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "group.yaml"
    path.write_text("name: g\nexecution: parallel\n---\nrun: a\n---\nrun: b\n")
    with pytest.raises(SpecError, match="a SkyPilot job group") as info:
        load_pipeline_yaml(path)
    assert info.value.field.endswith(": execution") and "sky_job_group(" in info.value.message
    with pytest.raises(SpecError, match=r"load it with sky_job_group\("):  # the single-task loader says so
        load_task_yaml(path)


GROUP = DAGS / "sky_test_job_group.yaml"


def test_a_job_group_is_a_gang_per_task_started_together_and_stopped_together() -> None:
    with DAG("g", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")) as dag:
        sky_job_group(GROUP)
    clusters = {"pair.server.cluster", "pair.client.cluster"}
    for task in ("server", "client"):
        job = dag.get_task(f"pair.{task}.job")
        assert clusters <= job.upstream_task_ids  # no job starts before every cluster is up
        assert job.spec_overrides.get("envs") is None  # the name is in the task itself, as a YAML field
        assert job.task_config["envs"][JOBGROUP_ENV] == "pair"
    assert (
        dag.get_task("pair.server.cluster").cluster_name != dag.get_task("pair.client.cluster").cluster_name
    )
    stop = dag.get_task("pair.stop_together")
    assert stop.trigger_rule == "one_failed"
    assert stop.upstream_task_ids == {"pair.server.gang", "pair.client.gang"}
    assert stop.gangs == [
        ("server", "pair.server.cluster", "pair.server.job"),
        ("client", "pair.client.cluster", "pair.client.job"),
    ]


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        (
            "name: g\nexecution: parallel\nprimary_tasks: [b]\n---\nname: a\nrun: x\n",
            ": primary_tasks",
            "no task",
        ),
        ("name: g\nexecution: parallel\nprimary_tasks: a\n---\nname: a\nrun: x\n", ": primary_tasks", "list"),
        (
            "name: g\nexecution: parallel\ntermination_delay: soon\n---\nname: a\nrun: x\n",
            ": termination_delay",
            "30s",
        ),
        (
            "name: g\nexecution: parallel\ntermination_delay: {b: 1s}\n---\nname: a\nrun: x\n",
            ": termination_delay",
            "no task",
        ),
        ("name: g\nexecution: parallel\n---\nrun: x\n", ": task #1", "this one has none"),
        (
            "name: g\nexecution: parallel\n---\nname: a\nrun: x\n---\nname: a\nrun: y\n",
            ": task #2",
            "given twice",
        ),
        ("execution: parallel\n---\nname: a\nrun: x\n", ": name", "needs a name"),
        ("name: g\n---\nname: a\nrun: x\n", "", "is not a SkyPilot job group"),
    ],
)
def test_a_job_group_file_names_what_cannot_run(tmp_path: Path, text: str, field: str, fragment: str) -> None:
    path = tmp_path / "group.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_job_group_yaml(path)
    assert info.value.field == f"{path}{field}" and fragment in info.value.message, info.value


def test_auxiliary_tasks_are_told_to_end_once_the_primary_ones_succeeded(tmp_path: Path) -> None:
    """SkyPilot's ``primary_tasks`` / ``termination_delay`` (a default and one per task)."""
    path = tmp_path / "group.yaml"
    path.write_text(
        "name: rl\nexecution: parallel\nprimary_tasks: [trainer]\n"
        "termination_delay: {default: 30s, buffer: 2m}\n"
        "---\nname: trainer\nrun: train\n---\nname: data\nrun: serve\n---\nname: buffer\nrun: keep\n"
    )
    group = load_job_group_yaml(path)
    assert (group.primary, group.delays) == (("trainer",), {"data": 30.0, "buffer": 120.0})
    with DAG("g", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")) as dag:
        sky_job_group(path)
    end = dag.get_task("rl.end_auxiliaries")
    assert end.upstream_task_ids == {"rl.trainer.gang"}  # after the primary task succeeded
    assert end.gangs == [("data", "rl.data.cluster", 30.0), ("buffer", "rl.buffer.cluster", 120.0)]
    data = dag.get_task("rl.data.job").task_config
    assert data["run"].startswith("# SkyPilot job group: an auxiliary task") and "\nserve\n" in data["run"]
    assert data["envs"][STOP_ENV] == ".sky-jobgroup/rl/{{ run_id }}"
    cluster = dag.get_task("rl.data.cluster")  # rendered per run: the path the end task writes
    cluster.render_template_fields({"run_id": "manual__r1", "dag": dag, "params": {}})  # type: ignore[arg-type]
    assert cluster.task_config["envs"][STOP_ENV] == stop_path("rl", "manual__r1")
    assert dag.get_task("rl.trainer.job").task_config["run"] == "train"
    assert STOP_ENV not in dag.get_task("rl.trainer.job").task_config["envs"]
    with DAG("h", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")) as dag:
        sky_job_group(GROUP)  # every task primary: nothing to end
    assert "pair.end_auxiliaries" not in dag.task_ids
