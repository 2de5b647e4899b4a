"""Faults and bad input without the Airflow services: secrets, injection, bad connection fields, re-attach."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from leaks import job_processes

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.backends.ssh import SSHBackend
from airflow_provider_sky.spec import SpecError, task_from_args
from airflow_provider_sky.watch.jobs import GangClient


@pytest.fixture
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


@pytest.mark.usefixtures("_db")
def test_secrets_stay_out_of_logs_xcom_and_rendered_fields(capfd: pytest.CaptureFixture[str]) -> None:
    from airflow.models.renderedtifields import RenderedTaskInstanceFields
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    from integration.test_dag_test import _load

    mod = _load("sky_test_secrets", folder="tests/dags")
    secret = mod.SECRET
    dr = mod.dag.test()
    out = "".join(capfd.readouterr())
    assert str(dr.state) == "success"
    assert "token is ***" in out and "setup sees ***" in out
    assert secret not in out
    with create_session() as session:
        xcoms = session.query(XComModel).filter(XComModel.run_id == dr.run_id).all()
        assert xcoms and all(secret not in json.dumps(x.value, default=str) for x in xcoms)
        rtifs = session.query(RenderedTaskInstanceFields).filter(
            RenderedTaskInstanceFields.run_id == dr.run_id
        )
        rendered = [json.dumps(r.rendered_fields, default=str) for r in rtifs]
        assert rendered and all(secret not in r for r in rendered)


@pytest.mark.parametrize(
    "name", ["a;touch /tmp/x", "../etc", "a b", "$(id)", "`id`", "a&&b", "n\u00e9", "a\nb", "-rf", ""]
)
def test_bad_cluster_names_are_rejected_at_parse_time(name: str) -> None:
    from airflow_provider_sky.operators.cluster import SkyClusterOperator

    if not name:
        return  # empty means "default name": allowed
    with pytest.raises(SpecError, match="cluster_name"):
        SkyClusterOperator(task_id="c", cluster_name=name, num_nodes=1, run="true")


@pytest.mark.parametrize("name", ["A B", "1X", "X-Y", "X;Y", "$(id)", "X\nY", "é"])
def test_bad_env_names_are_rejected(name: str) -> None:
    with pytest.raises(SpecError, match="envs"):
        task_from_args(num_nodes=1, run="true", envs={name: "v"})


def test_commands_and_values_arrive_verbatim_nothing_extra_runs(sky_home: Path, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    evil = (
        f'\'"; touch {canary}; echo "$(touch {canary})" `touch {canary}` && touch {canary} \u6f22\u5b57 \\n'
    )
    run = "printf '%s|' \"$EVIL\"\ncat <<'EOF'\n" + evil + "\nEOF\n"
    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=2, run=run, envs={"EVIL": evil}, name="inj")
    client = GangClient(b, b.provision("inj", spec))
    client.launch(spec, "job-inj")

    for _ in range(100):
        poll = client.poll("job-inj")
        if poll.status.done:
            break
        time.sleep(0.05)
    assert poll.status.succeeded
    assert client.poll("job-inj").chunks[1][1].decode() == evil + "|" + evil + "\n"
    assert not canary.exists()
    b.terminate("inj")


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"login": "u"}, "hosts"),
        ({"host": "10.0.0.1"}, "login"),
        ({"host": "10.0.0.1,10.0.0.2", "login": "u", "head": "10.0.0.3"}, "head"),
        ({"host": "10.0.0.1", "login": "u", "host_key_policy": "trust-me"}, "host_key_policy"),
        ({"host": "10.0.0.1", "login": "u", "port": "ssh"}, "port"),
        ({"host": "10.0.0.1,u@10.0.0.1:22", "login": "u"}, "hosts: '10.0.0.1:22' is listed twice"),
    ],
)
def test_bad_ssh_connection_fields_fail_before_any_contact(config: dict[str, Any], words: str) -> None:
    with pytest.raises((BackendError, ValueError), match=words):
        b = SSHBackend.from_config(config)
        b._config("10.0.0.1", 22)  # builds the node config: nothing connects


def test_a_misspelled_spec_field_is_named_at_dag_parse_time() -> None:
    from airflow_provider_sky.operators.cluster import SkyClusterOperator

    with pytest.raises(TypeError, match="num_node"):
        SkyClusterOperator(task_id="c", num_node=4, run="true")
    op = SkyClusterOperator(task_id="c", num_nodes=4, run="true", name="train")
    assert op.rendered_spec().num_nodes == 4 and op.rendered_spec().name == "train"


def test_backend_limit_and_unhonourable_fields_fail_before_provisioning(sky_home: Path) -> None:
    from airflow_provider_sky.hooks.sky import SkyHook

    hook = SkyHook(None)
    with pytest.raises(SpecError, match="num_nodes"):
        hook.provision("big", task_from_args(num_nodes=5000, run="true"))
    with pytest.raises(SpecError, match="use_spot"):
        hook.provision("spot", task_from_args(num_nodes=2, run="true", resources={"use_spot": True}))
    assert not (sky_home / "local" / "big").exists() and not (sky_home / "local" / "spot").exists()


@pytest.mark.usefixtures("_db")
def test_job_task_reattaches_instead_of_launching_twice(sky_home: Path, tmp_path: Path) -> None:
    """A job task retried after its worker died finds the running job in task_state_store."""
    from airflow_provider_sky.operators.job import SkyJobOperator

    counter = tmp_path / "starts"
    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=3, run=f"echo x >> {counter}-$SKYPILOT_NODE_RANK; sleep 30")
    handle = b.provision("re", spec).to_dict()
    op = SkyJobOperator(task_id="job", cluster=handle, num_nodes=3, run=spec.run, sky_conn_id=None)

    class Store(dict):  # what task_state_store keeps across attempts of one task instance
        def set(self, k: str, v: Any, **_: Any) -> None:
            self[k] = v

    class TI:
        dag_id, run_id, task_id, map_index = "d", "r", "job", -1

        def __init__(self, try_number: int) -> None:
            self.try_number = try_number
            self.stats_tags: dict[str, str] = {}
            self.pushed: dict[str, Any] = {}

        def xcom_push(self, key: str, value: Any) -> None:
            self.pushed[key] = value

    store = Store()
    first = op.execute({"ti": TI(1), "task_state_store": store})
    again = op.execute({"ti": TI(2), "task_state_store": store})  # the retry after a crash
    assert first == again  # same job id: re-attached
    for rank in range(3):
        assert Path(f"{counter}-{rank}").read_text() == "x\n"  # each rank started exactly once
    b.terminate("re")
    # the job task's launch-side watcher (the bridge) may have a status call of its own in flight on
    # the node as the teardown ends (seen once: rank 2's `status.sh` peek): it ends by itself within
    # its call, and the bridge with it once the cluster is gone (tests/conftest.py checks the bridge)
    deadline = time.monotonic() + 5
    while job_processes(sky_home) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not job_processes(sky_home)


def test_provider_cli_lists_connection_types() -> None:
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "airflow", "providers", "hooks", "-o", "json"], capture_output=True, text=True
    ).stdout
    assert "sky_ssh" in out and "sky_local" in out
