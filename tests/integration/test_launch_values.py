"""A SkyPilot YAML's null ``envs`` / ``secrets`` (SkyPilot's "given at launch", ``sky launch --env``/``--secret``)
under ``dag.test()``: given by the operator's arguments, by DAG params or by an Airflow Variable, the gang runs
with them; one never given fails the cluster task before anything is provisioned, naming every key."""

from __future__ import annotations

import hashlib
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module() -> ModuleType:
    from integration.test_dag_test import _load

    return _load("sky_test_launch_values", folder="tests/dags")


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def _run(dag_id: str) -> Any:
    return _module().DAGS[dag_id].test()


def _out(capfd: pytest.CaptureFixture[str]) -> str:
    out, err = capfd.readouterr()
    return out + err


@pytest.mark.parametrize(
    ("dag_id", "greeting", "source"),
    [
        ("launch_values_args", "hi", None),
        ("launch_values_params", "from-params", "a DAG param"),
        ("launch_values_variable", "p", "an Airflow Variable"),
    ],
)
def test_null_values_given_at_launch_run(
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    dag_id: str,
    greeting: str,
    source: str | None,
) -> None:
    token = _module().TOKEN
    if source == "an Airflow Variable":
        monkeypatch.setenv("AIRFLOW_VAR_API_TOKEN", token)  # a Variable, from Airflow's env secrets backend
    dr = _run(dag_id)
    text = _out(capfd)
    assert str(dr.state) == "success", text[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} greeting={greeting} fixed=1" in text
    assert f"token-sha {hashlib.sha256(token.encode()).hexdigest()[:16]}" in text  # the ranks got it
    assert token not in text  # and no log shows it
    if source:
        assert f"secrets.API_TOKEN from {source}" in text
    # what the local backend cannot give is named once, with why
    assert text.count("Ignored: service: SkyServe") == 1, text[-3000:]
    assert text.count("Ignored: resources.disk_tier: the local backend ignores disk_tier (best)") == 1


def test_a_value_never_given_fails_before_provisioning(
    capfd: pytest.CaptureFixture[str], sky_home: Path
) -> None:
    dr = _run("launch_values_missing")
    text = _out(capfd)
    assert str(dr.state) == "failed"
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert tis["g.cluster"].state == "failed"
    assert "envs.GREETING, secrets.API_TOKEN: no value given" in text, text[-3000:]
    for way in ("envs={'NAME': ...}", "a DAG param of the same name", "an Airflow Variable of the same name"):
        assert way in text
    assert "Provisioning cluster" not in text
    assert not list((sky_home / "local").glob("sky-*")), "nothing may be provisioned"
