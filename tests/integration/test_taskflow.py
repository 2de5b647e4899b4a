"""``@task.sky`` (TaskFlow): a function returning the run command becomes a whole gang, run under ``dag.test()``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from leaks import bridges
from siblings import matching

from unit.test_taskflow import _run


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB (migrated once per test process, whatever ran before)."""


def _xcom(dr: Any, task_id: str, key: str = "return_value", map_index: int = -1) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        query = XComModel.get_many(
            run_id=dr.run_id, key=key, task_ids=task_id, dag_ids=dr.dag_id, map_indexes=map_index
        )
        return XComModel.deserialize_value(session.scalars(query).one())


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
