"""Connections as a user keeps them: only a missing ``sky_default`` means "the local backend",
and a connection kept in the metadata DB is found under ``airflow dags test`` by the triggers too.

A lookup that fails for another reason (here a secrets backend that denies access, as a Vault policy does)
used to be swallowed too, and the job silently ran on this machine instead of the user's cluster. Real
Airflow secrets-backend loading, in a fresh process so the backend is configured before Airflow reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aws_fixtures import hosts, moto, net  # noqa: F401 (fixtures)
from sshd import SSHDCluster, needs_sshd

from unit.test_connection_lookup import PROBE

TESTS = Path(__file__).resolve().parents[1]  # helpers_secrets: a secrets backend the probes load


def _probe(extra_env: dict[str, str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
    env.update(extra_env)
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def test_a_missing_default_connection_means_the_local_backend() -> None:
    assert "CONFIG ('local', {})" in _probe({})


def test_a_default_connection_that_cannot_be_read_is_an_error_naming_it() -> None:
    text = _probe({"AIRFLOW__SECRETS__BACKEND": "helpers_secrets.DenyingSecretsBackend"})
    assert "CONFIG ('local'" not in text, text
    assert "ERROR" in text and "sky_default" in text and "policy denies" in text, text


# -- a connection kept in the metadata DB under ``dag.test()`` / ``airflow dags test`` -----------
#
# ``dag.test()`` runs each trigger inline through Airflow's in-process supervisor, whose comms answer only
# synchronous requests (no ``asend``): the Task SDK's async connection lookup through the Execution API then
# failed quietly and said "isn't defined", though the tasks (synchronous lookups) found the connection.
# ``AIRFLOW_CONN_*`` variables hid it (the environment backend is read before the Execution API).


@contextlib.contextmanager
def db_connection(conn_id: str, conn: dict[str, Any]) -> Iterator[None]:
    """``conn`` (the JSON form of an ``AIRFLOW_CONN_*`` variable) as a row of the metadata DB, for the test."""
    from airflow.models import Connection
    from airflow.utils.session import create_session

    with create_session() as session:
        session.add(Connection.from_json(json.dumps(conn), conn_id=conn_id))
    try:
        yield
    finally:
        with create_session() as session:
            session.query(Connection).filter(Connection.conn_id == conn_id).delete()


def _run_db_conn(monkeypatch: pytest.MonkeyPatch, conn_id: str) -> tuple[Any, dict[tuple[str, int], Any]]:
    from integration.test_dag_test import _run

    for name in [k for k in os.environ if k.startswith("AIRFLOW_CONN_")]:
        monkeypatch.delenv(name)  # the DB row, and nothing else, must be what is found
    monkeypatch.setenv("SKY_TEST_CONN_ID", conn_id)
    return _run("sky_test_db_conn", folder="tests/dags")


def _assert_ran(dr: Any, tis: dict[tuple[str, int], Any], out: str) -> None:
    from integration.test_dag_test import _states

    assert "isn't defined" not in out, out[-3000:]
    assert _states(tis, "rank") == {0: "success", 1: "success"}, out[-3000:]
    assert tis[("gang", -1)].state == "success"
    assert str(dr.state) == "success"


def test_dag_test_finds_a_local_connection_kept_in_the_db(
    airflow_db: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every task logged ``Connection schemes (type: sky_local) shall not contain
    '_' according to RFC3986``; the type is now ``skylocal`` (a URI scheme), ``sky_local`` still works."""
    with db_connection("sky_local", {"conn_type": "skylocal"}):
        dr, tis = _run_db_conn(monkeypatch, "sky_local")
    out = "".join(capfd.readouterr())
    _assert_ran(dr, tis, out)
    assert "shall not contain" not in out, out[-3000:]
    with db_connection("sky_old", {"conn_type": "sky_local"}):  # made before the rename: still read
        dr, tis = _run_db_conn(monkeypatch, "sky_old")
    _assert_ran(dr, tis, "".join(capfd.readouterr()))


@needs_sshd
def test_dag_test_finds_an_ssh_connection_kept_in_the_db(
    airflow_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from airflow_provider_sky.runners.ssh import pool

    with SSHDCluster(2, tmp_path) as hosts, db_connection("sky_ssh", json.loads(hosts.sky_ssh_connection())):
        try:
            dr, tis = _run_db_conn(monkeypatch, "sky_ssh")
        finally:
            pool.close_all()
    _assert_ran(dr, tis, "".join(capfd.readouterr()))


def test_dag_test_finds_a_kubernetes_sky_default_kept_in_the_db(
    airflow_db: Path,
    k8s: Any,
    k8s_image: Any,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """``sky_default`` as the README adds it. The triggers did not say "isn't defined" here: they fell
    back to the local backend (a missing ``sky_default`` means local) and watched this machine for the
    ranks running in the pods."""
    from k8s_cluster import connection_extras

    conn = {"conn_type": "sky_kubernetes", "extra": connection_extras(k8s, k8s_image)}
    with db_connection("sky_default", conn):
        dr, tis = _run_db_conn(monkeypatch, "sky_default")
    _assert_ran(dr, tis, "".join(capfd.readouterr()))


@needs_sshd
def test_dag_test_finds_an_aws_connection_and_its_linked_aws_connection_kept_in_the_db(
    airflow_db: Path,
    moto: Any,
    hosts: Any,
    net: Any,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The ``sky_aws`` connection and the ``aws`` one it links to (the credentials) both in the DB."""
    from aws_fixtures import conn

    extra = {k: v for k, v in conn(moto.url, hosts).items() if k not in ("login", "password")}
    aws = {"conn_type": "aws", "login": "testing", "password": "testing"}
    sky = {"conn_type": "sky_aws", "extra": {**extra, "aws_conn_id": "aws_db"}}
    with db_connection("aws_db", aws), db_connection("sky_ec2", sky):
        dr, tis = _run_db_conn(monkeypatch, "sky_ec2")
    _assert_ran(dr, tis, "".join(capfd.readouterr()))


def test_airflow_dags_test_cli_with_a_connection_added_by_the_cli(airflow_db: Path, sky_home: Path) -> None:
    """The README's steps as a user types them: ``airflow connections add``, then ``airflow dags test``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW_CONN_")}
    env["SKY_TEST_CONN_ID"] = "sky_cli"
    airflow = [sys.executable, "-m", "airflow"]
    add = subprocess.run(
        [*airflow, "connections", "add", "sky_cli", "--conn-type", "sky_local"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert add.returncode == 0, add.stderr[-2000:]
    try:
        run = subprocess.run(
            [*airflow, "dags", "test", "sky_test_db_conn"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        subprocess.run(
            [*airflow, "connections", "delete", "sky_cli"], env=env, capture_output=True, timeout=120
        )
    out = run.stdout + run.stderr
    assert "isn't defined" not in out, out[-3000:]
    assert "found its connection" in out and "state=success" in out, out[-3000:]
