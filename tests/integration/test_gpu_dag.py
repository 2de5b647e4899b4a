"""A SkyPilot GPU YAML as a whole DAG under ``dag.test()``: the cluster task picks the first
alternative this machine's GPUs allow and says so, the job task's ranks (and setup) see their own
CUDA_VISIBLE_DEVICES through the handle's XCom. The machine's GPUs are FAKE (tests/fakes on PATH)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpus import L4, local_gpus

from integration.test_dag_test import _out, _run, _states


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def test_a_skypilot_gpu_yaml_runs_as_a_dag(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    local_gpus(monkeypatch, tmp_path, [L4] * 4)
    dr, tis = _run("sky_test_gpus", "tests/dags")
    text = _out(capfd)
    assert str(dr.state) == "success", text[-3000:]
    assert _states(tis, "rank") == {0: "success", 1: "success"}
    assert "resources: alternative 2 of 2 (L4:2, cpus 4+); passed over: #1 (A100:8, cpus 4+)" in text
    assert "this machine has 4x L4 (nvidia-smi); the task asks for A100:8 per node" in text
    assert "GPUs L4 (CUDA_VISIBLE_DEVICES=2,3; the machine has 4x L4 (nvidia-smi))" in text
    assert "setup 1: 2 GPUs (2,3)" in text
    assert "rank 1 of 2 sees 2 GPUs: CUDA_VISIBLE_DEVICES=2,3" in text
    assert not list((sky_home / "local").glob("sky-*"))
