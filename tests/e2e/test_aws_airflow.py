"""EC2 under a real Airflow (api-server, scheduler with the LocalExecutor, dag-processor, triggerer):
a run cancelled by a user still tears its instances down, checked through moto's API; with the
triggerer killed during a gang, a rank's failure still stops its sibling (the head instance's agent
decides) and the run fails once a new triggerer is up.

``sky_default`` is a ``sky_aws`` connection to moto's server started here. Airflow's processes reach
the instances' SSH through the shared fake network (``FakeNetwork.share`` + ``tests/fake_ec2_site``,
on the services' ``PYTHONPATH`` with ``SKY_TEST_FAKE_EC2_NET``): the same mapping of moto instances to
real sshd hosts the in-process tests use, kept in a file under an flock.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from leaks import bridges
from moto_ec2 import IMAGE, REGION, FakeNetwork, MotoEC2, iter_instances
from siblings import matching
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.nodeagents import EXTRA_KEY
from devstack.stack import AirflowStack, StackError

pytestmark = [pytest.mark.airflow_services, needs_sshd]
TESTS = Path(__file__).resolve().parents[1]
DAG_ID = "sky_aws_cancel"
FAIL_DAG_ID = "sky_aws_fail"
#: rank 0 must be gone this soon after rank 1's fail file appears, the triggerer dead: rank 1's look
#: at the file (every 0.2 s), its host's agent, one message through the head instance's agent, a
#: signal, all on this machine's loopback hosts (the tight figures are benchmarks' fig_failfast_agent);
#: without the agents nothing would stop it until a triggerer polls again, which here is never before
#: this check
GONE_WITHOUT_TRIGGERER = 5.0


def _wait(what: str, check: Any, timeout: float, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def _assert_powered_off(net: FakeNetwork) -> None:
    """The run's hosts, powered off as EC2 does a terminated instance, run nothing of ours.

    The fake's power-off ends a host's processes but leaves its sshd answering: a cancel the rank tasks'
    ``on_kill`` sent as the run was marked failed can land after it (seen at a load average of 13: its
    ``cancel.sh`` waiting its 3 s grace). Such a late script ends by itself within its grace, so it gets
    up to 10 s to (the grace with a margin of 7 s); anything still running then fails this, as does a
    process on a host whose instance is still live."""
    net.power_off_gone()
    deadline = time.monotonic() + 10
    while net.hosts.rank_processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not net.hosts.rank_processes()


def _rank_1_runs(airflow: AirflowStack, run_id: str) -> bool:
    if airflow.dag_run(DAG_ID, run_id)["state"] in ("success", "failed"):
        raise AssertionError(f"the run ended before rank 1 ran: {airflow.task_instances(DAG_ID, run_id)}")
    try:
        return "rank 1 started" in airflow.task_log(DAG_ID, run_id, "g.rank", 1)
    except StackError:  # not mapped yet
        return False
    except httpx.TimeoutException:  # the API server under load (30 s): ask again
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AirflowStack, MotoEC2, FakeNetwork]]:
    base = tmp_path_factory.mktemp("aws-airflow")
    moto = MotoEC2().start()
    try:
        with SSHDCluster(3, base) as hosts:
            net = FakeNetwork(hosts, moto)
            shared = net.share(base / "fake-ec2-net.json")
            extra = {
                "region_name": REGION,
                "endpoint_url": moto.url,
                "private_key": hosts.client_key_text,
                "image_id": IMAGE,
                "provision_timeout": 120,
            }
            conn = {"conn_type": "sky_aws", "login": "testing", "password": "testing", "extra": extra}
            dags = base / "dags"
            dags.mkdir()
            (dags / f"{DAG_ID}.py").symlink_to(TESTS / "dags" / f"{DAG_ID}.py")  # and FAIL_DAG_ID
            env = {
                "AIRFLOW_CONN_SKY_DEFAULT": json.dumps(conn),
                "SKY_TEST_FAKE_EC2_NET": str(shared),
                "PYTHONPATH": str(TESTS / "fake_ec2_site"),
                "SKY_PROVIDER_HOME": str(base / "sky"),
            }
            with AirflowStack(base / "airflow", dags, env) as airflow:
                yield airflow, moto, net
            net.power_off_gone()
    finally:
        moto.stop()


def test_a_run_cancelled_by_a_user_terminates_every_instance(
    stack: tuple[AirflowStack, MotoEC2, FakeNetwork],
) -> None:
    """A user marks a running rank failed (its trigger's on_kill cancels the gang): the run fails, the
    teardown task runs and every instance of the run is terminated, its security group and key pair
    deleted; nothing of ours is left in moto and no rank process on the hosts."""
    airflow, moto, net = stack
    ec2 = moto.client()
    run_id = airflow.trigger(DAG_ID)

    _wait("rank 1 to run", lambda: _rank_1_runs(airflow, run_id), 240)
    live = [i["InstanceId"] for i in iter_instances(ec2) if i["State"]["Name"] == "running"]
    assert len(live) == 2
    airflow.mark_failed(DAG_ID, run_id, "g.rank", 1)
    assert airflow.wait_run(DAG_ID, run_id, timeout=240) == "failed"
    tis = {(t["task_id"], t["map_index"]): t for t in airflow.task_instances(DAG_ID, run_id)}
    assert tis[("g.down", -1)]["state"] == "success", tis[("g.down", -1)]
    assert {
        i["InstanceId"]: i["State"]["Name"] for i in iter_instances(ec2, InstanceIds=live)
    } == dict.fromkeys(live, "terminated")
    owner = [{"Name": "tag:sky-airflow:owner", "Values": ["airflow-provider-sky"]}]
    assert ec2.describe_security_groups(Filters=owner)["SecurityGroups"] == []
    assert ec2.describe_key_pairs(Filters=owner)["KeyPairs"] == []
    _assert_powered_off(net)


def test_a_run_marked_failed_by_a_user_terminates_every_instance(
    stack: tuple[AirflowStack, MotoEC2, FakeNetwork],
) -> None:
    """A user marks the whole running run failed (the run's state, not a task's): Airflow 3.3 fails the
    running tasks (the ranks' on_kill cancels the gang) and still runs the teardown task, which
    terminates every instance of the run and deletes its security group and key pair."""
    airflow, moto, net = stack
    ec2 = moto.client()
    before = {i["InstanceId"] for i in iter_instances(ec2)}
    run_id = airflow.trigger(DAG_ID)
    _wait("rank 1 to run", lambda: _rank_1_runs(airflow, run_id), 240)
    live = [i["InstanceId"] for i in iter_instances(ec2) if i["InstanceId"] not in before]
    assert len(live) == 2
    path = f"/api/v2/dags/{DAG_ID}/dagRuns/{run_id}"
    airflow._request("PATCH", path, json={"state": "failed"})
    t = time.monotonic()

    def gone() -> bool:
        return {i["State"]["Name"] for i in iter_instances(ec2, InstanceIds=live)} == {"terminated"}

    try:
        _wait("every instance of the run to be terminated", gone, 180)
    finally:
        tis = {(t["task_id"], t["map_index"]): t["state"] for t in airflow.task_instances(DAG_ID, run_id)}
        print(
            f"\nrun marked failed: task states {tis}; instances {'gone' if gone() else 'LEFT'} after {time.monotonic() - t:.0f}s"
        )
    down = _wait(
        "the down task to end",
        lambda: (
            airflow.task_instance(DAG_ID, run_id, "g.down")["state"] in ("success", "failed")
            and airflow.task_instance(DAG_ID, run_id, "g.down")["state"]
        ),
        120,
    )
    assert down == "success"
    owner = [{"Name": "tag:sky-airflow:owner", "Values": ["airflow-provider-sky"]}]
    assert ec2.describe_security_groups(Filters=owner)["SecurityGroups"] == []
    assert ec2.describe_key_pairs(Filters=owner)["KeyPairs"] == []
    _assert_powered_off(net)


def test_a_failure_stops_the_sibling_with_the_triggerer_killed_and_the_run_fails_once_it_is_back(
    stack: tuple[AirflowStack, MotoEC2, FakeNetwork],
) -> None:
    """The triggerer (every rank's trigger, the shared poll) is killed (SIGKILL) while a 2-instance gang
    runs on the node agents, then rank 1 exits 1: the head instance's agent stops rank 0 with no Airflow
    process watching; a new triggerer picks the rank triggers up, the run fails with each rank's task
    saying why, and the teardown terminates both instances."""
    airflow, moto, net = stack
    ec2 = moto.client()
    shared = Path(tempfile.mkdtemp(prefix="sky-aws-fail-"))
    shared.chmod(0o755)  # rank 1 runs as its host's user: it must see the file the test (root) creates
    fail_file = shared / "fail"
    try:
        before = {i["InstanceId"] for i in iter_instances(ec2)}
        run_id = airflow.trigger(FAIL_DAG_ID, {"fail_file": str(fail_file)})

        def deferred() -> bool:
            if airflow.dag_run(FAIL_DAG_ID, run_id)["state"] not in ("queued", "running"):
                raise AssertionError(airflow.task_instances(FAIL_DAG_ID, run_id))
            states = [
                t["state"] for t in airflow.task_instances(FAIL_DAG_ID, run_id) if t["task_id"] == "g.rank"
            ]
            return len(states) == 2 and all(s == "deferred" for s in states)

        _wait("both rank tasks to defer", deferred, 240, interval=1.0)
        handle = airflow.xcom(FAIL_DAG_ID, run_id, "g.cluster")
        assert EXTRA_KEY in handle["extra"], airflow.task_log(FAIL_DAG_ID, run_id, "g.cluster")
        assert not bridges(Path(airflow.env["SKY_PROVIDER_HOME"]))  # the head took the gang
        job_id = str(airflow.xcom(FAIL_DAG_ID, run_id, "g.job")[0]["job_id"])
        marker = f"SKYPILOT_TASK_ID={job_id}"
        assert len(matching(marker, ("sleep", "600"))) == 1
        live = [i["InstanceId"] for i in iter_instances(ec2) if i["InstanceId"] not in before]
        assert len(live) == 2

        airflow.kill_service("triggerer")
        try:
            t0 = time.monotonic()
            fail_file.touch()
            gone_at = None
            while time.monotonic() - t0 < 60:
                if not matching(marker, ("sleep", "600")):
                    gone_at = time.monotonic() - t0
                    break
                time.sleep(0.05)
            print(f"\nEC2, triggerer killed: rank 1's fail file -> rank 0 gone {gone_at}s")
            assert gone_at is not None and gone_at < GONE_WITHOUT_TRIGGERER, gone_at
        finally:
            airflow.start_service("triggerer")

        assert airflow.wait_run(FAIL_DAG_ID, run_id, timeout=240) == "failed"
        tis = {
            (t["task_id"], t["map_index"]): t["state"] for t in airflow.task_instances(FAIL_DAG_ID, run_id)
        }
        assert tis[("g.rank", 0)] == tis[("g.rank", 1)] == "failed", tis
        assert tis[("g.down", -1)] == "success", tis
        ip1 = handle["nodes"][1]["ip"]
        assert f"rank 1 ({ip1}) exited with code 1" in airflow.task_log(FAIL_DAG_ID, run_id, "g.rank", 1)
        log0 = airflow.task_log(FAIL_DAG_ID, run_id, "g.rank", 0)
        assert "cancelled" in log0 and "rank 1" in log0, log0
        assert {i["State"]["Name"] for i in iter_instances(ec2, InstanceIds=live)} == {"terminated"}
        _assert_powered_off(net)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
