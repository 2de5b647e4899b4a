"""A gang as one step of a pipeline, under a real Airflow: the checks, run on the stacks of other modules.

``dags_examples/sky_pipeline.py`` is the chain: ``prepare`` → the gang (rank 0 writes a JSON result, the
gang updates an asset) → ``evaluate`` (reads the result), and a second DAG, ``sky_pipeline_publish``,
scheduled on that asset. ``tests/dags/sky_test_pipeline_fail.py`` is the same with a failing rank: no
result, no asset event, no consumer run. Runs are triggered the way the UI's Params form does (a run
``conf``). What is asserted is read back from Airflow's REST API.

No stack of its own: ``test_airflow_real`` (SSH hosts, then Kubernetes) and ``test_airflow_celery``
(the local backend on PostgreSQL and Celery) import :func:`pipeline` and the tests, which then run on
their ``real`` stack once that module's own runs have ended (the DAG files are in every such stack's
folder: :data:`DAG_FILES`). A stack of its own per backend cost a start and, on Kubernetes, minutes
of waiting for the cluster's CPUs that ``real`` already holds. The leak checks are the stack's module's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import pytest

from devstack.stack import AirflowStack

if TYPE_CHECKING:
    from e2e.test_airflow_real import RealAirflow

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 180.0
#: the DAG files beyond ``dags_examples`` (which has ``sky_pipeline.py``) a stack's folder needs
DAG_FILES = (
    REPO / "tests" / "dags" / "sky_test_pipeline_fail.py",
    REPO / "tests" / "dags" / "sky_test_pipeline_line.py",
)


class Pipeline:
    def __init__(self, stack: AirflowStack, real: RealAirflow, runs: dict[str, str]) -> None:
        #: ``real``: the importing module's stack view (its ``assert_cleaned_up`` checks a run's cluster)
        self.stack, self.real, self.runs = stack, real, runs

    def finished(self, name: str, dag_id: str) -> tuple[str, str]:
        run_id = self.runs[name]
        return run_id, self.stack.wait_run(dag_id, run_id, timeout=RUN_TIMEOUT)

    def tis(self, dag_id: str, run_id: str) -> dict[tuple[str, int], dict[str, Any]]:
        return {(t["task_id"], t["map_index"]): t for t in self.stack.task_instances(dag_id, run_id)}

    def dag_runs(self, dag_id: str) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = self.stack._request("GET", f"/api/v2/dags/{quote(dag_id)}/dagRuns")[
            "dag_runs"
        ]
        return runs

    def asset_events(self, dag_id: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = self.stack._request(
            "GET", "/api/v2/assets/events", params={"source_dag_id": dag_id, "limit": 100}
        )["asset_events"]
        return events


@pytest.fixture(scope="module")
def pipeline(real: RealAirflow) -> Iterator[Pipeline]:
    """The pipeline's runs on the importing module's ``real`` stack, started once its own runs ended."""
    stack = real.stack
    for dag_id, run_id in real.run_ids.items():
        stack.wait_run(dag_id, run_id, timeout=RUN_TIMEOUT)
    # the consumers first: a DAG scheduled on an asset must be unpaused to be run by its events
    stack.unpause("sky_pipeline_publish")
    stack.unpause("sky_test_pipeline_fail_consumer")
    runs = {
        # the Params form: 3 nodes and a learning rate instead of the defaults (2, 0.001)
        "form": stack.trigger("sky_pipeline", {"num_nodes": 3, "envs": {"LR": "0.5"}}),
        # a value the form's schema lets through but no node can have: refused, naming the param
        "bad": stack.trigger("sky_pipeline", {"resources": {"cpus": "many"}}),
        "fail": stack.trigger("sky_test_pipeline_fail"),
        "line": stack.trigger("sky_test_pipeline_line"),
    }
    yield Pipeline(stack, real, runs)


def test_the_chain_runs_end_to_end(pipeline: Pipeline) -> None:
    """The form's 3 nodes are provisioned, rank 0's JSON reaches ``evaluate``, and the asset's consumer
    runs once the gang succeeded, with the run, nodes, duration and result in the event's extra."""
    stack = pipeline.stack
    run_id, state = pipeline.finished("form", "sky_pipeline")
    tis = pipeline.tis("sky_pipeline", run_id)
    assert state == "success", tis
    ranks = sorted(i for (tid, i) in tis if tid == "train.rank")
    assert ranks == [0, 1, 2], "the Params form's num_nodes=3 was provisioned"
    handle = stack.xcom("sky_pipeline", run_id, "train.cluster")
    assert len(handle["nodes"]) == 3
    result = stack.xcom("sky_pipeline", run_id, "train.gang")
    assert result == {"loss": 0.25, "nodes": 3, "checkpoint": f"ckpt/{run_id}"}, result
    assert stack.xcom("sky_pipeline", run_id, "evaluate") == 0.25
    assert "(lr 0.5)" in stack.task_log("sky_pipeline", run_id, "train.rank", 1)  # the form's envs
    events = [e for e in pipeline.asset_events("sky_pipeline") if e["source_run_id"] == run_id]
    assert len(events) == 1, events
    extra = events[0]["extra"]
    assert extra["run_id"] == run_id and extra["nodes"] == 3 and extra["result"] == result, extra
    assert 0 <= extra["duration"] < 60, extra  # a node clock in whole seconds may give 0
    # the consumer DAG, scheduled on the asset, ran after the training with the event's extra
    deadline = time.monotonic() + 90
    while not (runs := pipeline.dag_runs("sky_pipeline_publish")) and time.monotonic() < deadline:
        time.sleep(1)
    assert runs, "no run of sky_pipeline_publish after the gang's asset event"
    published = runs[0]["dag_run_id"]
    assert stack.wait_run("sky_pipeline_publish", published, timeout=RUN_TIMEOUT) == "success"
    assert stack.xcom("sky_pipeline_publish", published, "publish")["run_id"] == run_id
    pipeline.real.assert_cleaned_up("sky_pipeline", run_id)


def test_an_invalid_form_value_is_refused_before_provisioning(pipeline: Pipeline) -> None:
    stack = pipeline.stack
    run_id, state = pipeline.finished("bad", "sky_pipeline")
    assert state == "failed"
    tis = pipeline.tis("sky_pipeline", run_id)
    assert tis[("train.cluster", -1)]["state"] == "failed"
    log = stack.task_log("sky_pipeline", run_id, "train.cluster")
    assert "resources.cpus" in log and "params.resources" in log and "nothing was provisioned" in log, log
    assert "Provisioning cluster" not in log
    assert stack.xcom("sky_pipeline", run_id, "train.gang") is None
    assert not [e for e in pipeline.asset_events("sky_pipeline") if e["source_run_id"] == run_id]


def test_a_failed_gang_pushes_no_result_and_emits_no_event(pipeline: Pipeline) -> None:
    stack = pipeline.stack
    run_id, state = pipeline.finished("fail", "sky_test_pipeline_fail")
    assert state == "failed"
    tis = pipeline.tis("sky_test_pipeline_fail", run_id)
    assert tis[("train.gang", -1)]["state"] == "failed"
    assert tis[("evaluate", -1)]["state"] == "upstream_failed"
    assert tis[("train.down", -1)]["state"] == "success"
    assert stack.xcom("sky_test_pipeline_fail", run_id, "train.gang") is None
    assert pipeline.asset_events("sky_test_pipeline_fail") == []
    time.sleep(5)  # a scheduler loop or two: an event would have started the consumer by now
    assert pipeline.dag_runs("sky_test_pipeline_fail_consumer") == []
    pipeline.real.assert_cleaned_up("sky_test_pipeline_fail", run_id)


def test_without_outlets_the_triggerer_pushes_the_last_line(pipeline: Pipeline) -> None:
    """No outlets: the gang sensor starts and ends in the triggerer, whose success event carries the result."""
    stack = pipeline.stack
    run_id, state = pipeline.finished("line", "sky_test_pipeline_line")
    assert state == "success", pipeline.tis("sky_test_pipeline_line", run_id)
    assert stack.xcom("sky_test_pipeline_line", run_id, "train.gang") == "rank 0 says 42"
    assert stack.xcom("sky_test_pipeline_line", run_id, "evaluate") == "RANK 0 SAYS 42"
