"""Lost nodes replaced between attempts of a gang with retries: the healthy nodes are kept, the
new node is set up before the next attempt, whose ``SKYPILOT_NODE_IPS`` lists its address.

Real parts: local nodes (a lost one = its directory removed), real sshd hosts (a lost one = its sshd and
processes killed; a spare host of the connection takes its rank), the Kubernetes test cluster (a pod
deleted mid-run), AWS on moto's server.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aws_fixtures import hosts, moto, net  # noqa: F401 (fixtures of the AWS test)
from leaks import job_processes, processes_under

from airflow_provider_sky.spec import TaskSpec, task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.retry import GangPoll, RetryPolicy, watch_attempts
from airflow_provider_sky.watch.setup_stage import run_setup

SECRET = "s3cret-value-42"
#: setup leaves a file in the node's home naming its rank and the cluster's addresses
SETUP = (
    'printf "setup rank %s token %s ips %s\\n" "$SKYPILOT_SETUP_NODE_RANK" "${#TOKEN}" '
    '"$(printf %s "$SKYPILOT_SETUP_NODE_IPS" | tr "\\n" " ")" > setup_done'
)
#: every rank says what it got; attempt 1 runs until the test loses a node
RUN = (
    'echo "rank $SKYPILOT_NODE_RANK attempt $SKY_ATTEMPT ip $(hostname -I 2>/dev/null | cut -d" " -f1) '
    'ips $(printf %s "$SKYPILOT_NODE_IPS" | tr "\\n" " ") master $MASTER_ADDR token ${#TOKEN} '
    'setup $(cat setup_done 2>/dev/null | tr " " _) wd $(cat wd.txt 2>/dev/null)"; '
    'if [ "$SKY_ATTEMPT" = 1 ]; then sleep 1000; fi'
)


def _spec(n: int, **kw: Any) -> TaskSpec:
    return task_from_args(num_nodes=n, setup=SETUP, run=RUN, secrets={"TOKEN": SECRET}, **kw)


def _workdir(tmp_path: Path) -> str:
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "wd.txt").write_text("from-the-workdir\n")
    return str(wd)


def _start(client: GangClient, spec: TaskSpec) -> None:
    """Workdir and setup on every node (as the cluster task does), then attempt 1 with the secrets kept
    for retries."""
    client.backend.sync_files(client.handle, spec)
    run_setup(client, spec, "setup1", on_log=lambda r, line: None, poll_interval=0.2)
    client.keep_secrets = True
    client.launch(spec, "job")


def _watch(
    client: GangClient, policy: RetryPolicy, lose: Callable[[], None], timeout: float = 180.0, **kw: Any
) -> GangPoll:
    """The attempts loop to its end; ``lose`` runs (in a thread) once attempt 1 runs on every rank."""

    async def go() -> GangPoll:
        last: GangPoll | None = None
        fired = 0.0
        async for poll in watch_attempts(client, "job", policy=policy, poll_interval=0.2, **kw):
            if last is not None and last.attempt == 1 and poll.attempt == 2 and fired:
                print(f"\nnode lost -> attempt 2 polled on the new node: {time.time() - fired:.1f}s")
            last = poll
            if not fired and poll.attempt == 1 and all(r.state == "running" for r in poll.status.ranks):
                fired = time.time()
                threading.Thread(target=lose, daemon=True).start()
        assert last is not None
        return last

    return asyncio.run(asyncio.wait_for(go(), timeout))


def _said(client: GangClient, job_id: str) -> dict[int, str]:
    """Each rank's first line in job ``job_id`` (read through the nodes)."""

    async def go() -> dict[int, str]:
        out = {}
        for r in range(client.num_ranks):
            data = await client.aread_log(job_id, r, 0, 4096)
            out[r] = data.decode().splitlines()[0] if data else ""
        return out

    return asyncio.run(go())


def _check_attempt_2(
    client: GangClient, final: GangPoll, lost: int, old_ips: list[str], workdir: bool = False
) -> None:
    """Attempt 2 ran on the kept nodes and the new one, each rank with the cluster's new addresses."""
    assert final.final and final.attempt == 2 and final.status.succeeded, final.message()
    new_ips = client.handle.ips
    assert new_ips[lost] != old_ips[lost]
    assert [ip for r, ip in enumerate(new_ips) if r != lost] == [
        ip for r, ip in enumerate(old_ips) if r != lost
    ]
    why = final.history[0]["why"]
    assert why == (
        f"rank {lost} was lost, retryable (lost nodes are retried); rank {lost}'s node {old_ips[lost]} "
        f"was replaced by {new_ips[lost]}"
    ), why
    said = _said(client, "job.a2")
    ips = " ".join(new_ips)
    for r, line in said.items():
        assert line.startswith(f"rank {r} attempt 2 "), said
        assert f" ips {ips} master {new_ips[0]} token {len(SECRET)} " in line, said
        assert "setup setup_rank" in line, said  # setup ran on this node
        if workdir:  # the new node got the synced workdir too
            assert line.endswith(" wd from-the-workdir"), said
    # the new node was set up (its own rank, the new addresses, the secrets) before attempt 2 started
    assert f"setup setup_rank_{lost}_token_{len(SECRET)}_ips_{'_'.join(new_ips)}" in said[lost], said[lost]


# -- local --------------------------------------------------------------------------------------------------


def _lose_local(home: Path) -> None:
    """A local node is lost as a machine is: its processes die at once and its directory goes. They are
    stopped first, until a scan finds no new one, then killed: a process killed while its siblings
    still run could see a child of theirs born after the scan outlive the "machine" (a wrapper forks
    its watchdog's ``sleep 2`` as its command ends). The directory goes at once, by a rename, as a lost
    machine's disk does: removed in place, a poll of the watcher running meanwhile (it writes ``polled``
    in each rank's directory) could put a file back into a directory being removed, and leave a node
    with its rank's records half gone instead of a lost one."""
    stopped: set[int] = set()
    while True:
        new = [pid for pid, _ in processes_under(home) if pid not in stopped]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
            stopped.add(pid)
    for pid in stopped:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    gone = home.with_name(home.name + ".lost")
    home.rename(gone)
    shutil.rmtree(gone)


def test_local_lost_node_is_replaced_and_the_retry_succeeds(sky_home: Path, tmp_path: Path) -> None:
    from airflow_provider_sky.backends.local import LocalBackend

    backend = LocalBackend(sky_home)
    spec = _spec(3, workdir=_workdir(tmp_path))
    client = GangClient(backend, backend.provision("c", spec))
    old_ips = client.handle.ips
    _start(client, spec)
    final = _watch(client, RetryPolicy.build(retries=1), lambda: _lose_local(Path(client.node_of(1).home)))
    _check_attempt_2(client, final, 1, old_ips, workdir=True)
    assert f"rank 1's node {old_ips[1]} was replaced by {client.handle.ips[1]}" in final.note
    # the record names the new node, so a restarted watcher and the teardown both find it
    recorded = backend.find("c")
    assert recorded is not None and recorded.ips == client.handle.ips
    assert [r["rank"] for r in recorded.extra["replaced"]] == [1]
    assert SECRET not in "".join(p.read_text(errors="replace") for p in sky_home.rglob("*") if p.is_file()), (
        "a secret was left on disk"
    )
    assert backend.terminate("c").removed
    assert not job_processes(sky_home)


def test_a_backend_that_cannot_replace_fails_the_retry_saying_why(sky_home: Path) -> None:
    from airflow_provider_sky.backends.base import BackendError
    from airflow_provider_sky.backends.local import LocalBackend

    class NoReplace(LocalBackend):
        def replace_nodes(self, handle: Any, ranks: Any) -> Any:
            raise BackendError("the test backend cannot replace a lost node")

    backend = NoReplace(sky_home)
    spec = _spec(2)
    client = GangClient(backend, backend.provision("c", spec))
    _start(client, spec)
    lost_home = Path(client.node_of(1).home)
    final = _watch(client, RetryPolicy.build(retries=2), lambda: _lose_local(lost_home))
    assert final.final and final.attempt == 1 and not final.status.succeeded
    assert re.search(
        r"attempt 2 not started: lost node\(s\) of rank 1 \(\S+\) not replaced: the test backend cannot "
        r"replace a lost node",
        final.message(),
    ), final.message()
    backend.terminate("c")
    assert not job_processes(sky_home)


# -- SSH: a spare host of the connection takes a lost host's rank --------------------------------------------


def test_ssh_spare_host_takes_a_lost_hosts_rank_and_teardown_cleans_it(tmp_path: Path) -> None:
    from sshd import SKIP_REASON, SSHDCluster, user_processes

    from airflow_provider_sky.backends.ssh import SSHBackend
    from airflow_provider_sky.runners import ssh

    if SKIP_REASON:
        pytest.skip(SKIP_REASON)
    with SSHDCluster(4, tmp_path) as c:
        hosts = c.host_list()
        backend = SSHBackend(
            hosts[:3],
            spare_hosts=hosts[3:],
            user="",
            key_file=c.client_key_path,
            known_hosts=c.known_hosts_path,
            connect_timeout=3.0,
            ready_timeout=3.0,
        )
        spec = _spec(3, workdir=_workdir(tmp_path))
        client = GangClient(backend, backend.provision("spare", spec))
        old_ips = client.handle.ips
        assert c.nodes[3].host not in old_ips  # the spare is kept aside
        _start(client, spec)
        final = _watch(client, RetryPolicy.build(retries=1), lambda: c.kill_node(1), lost_after=2.0)
        _check_attempt_2(client, final, 1, old_ips, workdir=True)
        assert client.handle.ips[1] == c.nodes[3].host  # the spare took rank 1
        spare_root = client.node_of(1).root
        assert spare_root.startswith(c.nodes[3].home)
        assert backend.terminate("spare").removed  # the record names the spare: it is cleaned too
        assert not Path(spare_root).exists()
        client.close()
        backend.close()
        ssh.close_all()
        for i in (0, 2, 3):  # no rank, setup or session of any attempt is left on a host
            assert _settles(lambda i=i: user_processes(c.nodes[i].user) == []), i


def test_ssh_spare_hosts_are_checked_naming_the_field() -> None:
    from airflow_provider_sky.backends.base import BackendError
    from airflow_provider_sky.backends.ssh import SSHBackend

    with pytest.raises(BackendError, match=r"spare_hosts: '10\.0\.0\.2' is also in hosts"):
        SSHBackend.from_config({"host": "10.0.0.1,10.0.0.2", "login": "u", "spare_hosts": "10.0.0.2"})
    with pytest.raises(
        BackendError, match=r"spare_hosts: expected hosts as a comma-separated text or a list"
    ):
        SSHBackend.from_config({"host": "10.0.0.1", "login": "u", "spare_hosts": 7})
    b = SSHBackend.from_config({"host": "10.0.0.1", "login": "u", "spare_hosts": "v@10.0.0.9:2222, 10.0.0.8"})
    assert b.spares == [("10.0.0.9", 2222), ("10.0.0.8", 22)] and b.users[("10.0.0.9", 2222)] == "v"
    assert b.capabilities.max_nodes == 1  # spares are not nodes of a new cluster
    # a declared extra of the sky_ssh connection (the form shows it; an unknown extra would be refused)
    from unit.test_connection_config import ssh_settings

    assert ssh_settings({"spare_hosts": "10.0.0.9, u@10.0.0.8"}, host="h").spare_hosts == (
        "10.0.0.9",
        "u@10.0.0.8",
    )


def test_ssh_without_spares_the_retry_fails_naming_spare_hosts() -> None:
    from airflow_provider_sky.backends.base import BackendError, ClusterHandle
    from airflow_provider_sky.backends.ssh import SSHBackend

    b = SSHBackend.from_config({"host": "10.0.0.1", "login": "u"})
    with pytest.raises(BackendError, match="no spare host: list hosts kept aside .* spare_hosts extra"):
        b.replace_nodes(ClusterHandle("c", "ssh", (), "ssh"), [0])


def _settles(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


# -- Kubernetes: a deleted pod is replaced by a new worker pod ----------------------------------------------


def test_k8s_deleted_pod_is_replaced_and_the_retry_succeeds(k8s: Any, k8s_image: Any) -> None:
    from k8s_cluster import connection_extras

    from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
    from airflow_provider_sky.backends.kubernetes.manifest import CLUSTER_LABEL
    from airflow_provider_sky.backends.registry import by_kind

    backend = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    assert isinstance(backend, KubernetesBackend)
    try:
        spec = _spec(3)
        client = GangClient(backend, backend.provision("repl", spec))
        old_ips = client.handle.ips
        lost_pod = client.node_of(2).extra["pod"]
        _start(client, spec)

        def lose() -> None:
            backend.core.delete_namespaced_pod(lost_pod, backend.namespace, grace_period_seconds=0)

        final = _watch(client, RetryPolicy.build(retries=1), lose, timeout=300, lost_after=3.0)
        _check_attempt_2(client, final, 2, old_ips)
        new_pod = client.node_of(2).extra["pod"]
        kept_pod = client.node_of(1).extra["pod"]
        assert new_pod not in (lost_pod, "repl-head", kept_pod), new_pod
        pods = {
            p.metadata.name: p
            for p in backend.core.list_namespaced_pod(
                backend.namespace, label_selector=f"{CLUSTER_LABEL}=repl"
            ).items
        }
        assert lost_pod not in pods or pods[lost_pod].metadata.deletion_timestamp is not None
        assert pods[new_pod].metadata.labels == pods[kept_pod].metadata.labels  # same labels
        assert backend.terminate("repl").removed
        left = backend.core.list_namespaced_pod(
            backend.namespace, label_selector=f"{CLUSTER_LABEL}=repl"
        ).items
        # every pod goes, the new one included (a loaded kubelet may take past the teardown's wait)
        assert all(p.metadata.deletion_timestamp is not None for p in left), [p.metadata.name for p in left]
        client.close()
    finally:
        backend.terminate("repl", holder=None)
        backend.close()


# -- AWS on moto's server: a terminated instance is replaced by a new one -----------------------------------


def test_aws_terminated_instance_is_replaced_and_the_retry_succeeds(moto: Any, hosts: Any, net: Any) -> None:
    from aws_fixtures import backend as aws_backend
    from moto_ec2 import iter_instances

    ec2 = moto.client()
    b = aws_backend(moto.url, hosts)
    try:
        spec = _spec(3)
        client = GangClient(b, b.provision("repl", spec))
        old_ips = client.handle.ips
        lost_id = client.node_of(2).node_id
        _start(client, spec)

        def lose() -> None:  # EC2 ends the instance (a spot interruption, a failed host): its processes end
            ec2.terminate_instances(InstanceIds=[lost_id])
            net.power_off_gone()

        final = _watch(client, RetryPolicy.build(retries=1), lose, timeout=300, lost_after=3.0)
        _check_attempt_2(client, final, 2, old_ips)
        states = {i["InstanceId"]: i for i in iter_instances(ec2)}
        new_id = client.node_of(2).node_id
        assert states[lost_id]["State"]["Name"] == "terminated"
        assert states[new_id]["State"]["Name"] == "running"
        tags = {t["Key"]: t["Value"] for t in states[new_id]["Tags"]}
        assert tags["sky-airflow:cluster"] == "repl" and tags["sky-airflow:role"] == "worker"
        assert states[new_id]["InstanceType"] == states[client.node_of(1).node_id]["InstanceType"]
        found = aws_backend(moto.url, hosts).find("repl")  # another worker finds the new rank order
        assert found is not None and [n.node_id for n in found.nodes] == [
            n.node_id for n in client.handle.nodes
        ]
        client.close()
        assert b.terminate("repl").removed
        assert all(i["State"]["Name"] == "terminated" for i in iter_instances(ec2))
    finally:
        b.terminate("repl")
        b.close()


# -- under dag.test(): the rank tasks' logs name the replacement, the teardown task cleans the new node ------


def test_dag_test_lost_local_node_replaced_rank_tasks_show_it(
    sky_home: Path, airflow_db: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from integration.test_dag_test import _out, _run, _states, _xcom

    dr, tis = _run("sky_test_replace", folder="tests/dags")
    out = _out(capfd)
    assert str(dr.state) == "success", out[-5000:]
    assert _states(tis, "rank") == {0: "success", 1: "success", 2: "success"}
    assert tis[("down", -1)].state == "success"
    boundary = re.search(
        r"==== attempt 2/2: rank 1 was lost, retryable \(lost nodes are retried\); rank 1's node "
        r"(127\.\d+\.0\.2) was replaced by (127\.\d+\.0\.4) ====",
        out,
    )
    assert boundary, out[-5000:]
    old, new = boundary.groups()
    # every rank task's log shows it at the boundary (three watchers under dag.test(): one replaced, the
    # others waited for it and read the new node from the record)
    assert out.count(f"rank 1's node {old} was replaced by {new} ====") == 3, out[-5000:]
    line = re.search(r"rank 1 attempt 2 ips (\S+) (\S+) (\S+)set up as rank 1", out)
    assert line and line.group(2) == new, out[-5000:]  # the new node was set up, and every rank sees it
    assert re.search(rf"rank 0 attempt 2 ips \S+ {re.escape(new)} \S+set up as rank 0", out)
    summary = _xcom(dr, "train.rank", "sky_rank", 1)
    assert summary["state"] == "succeeded" and summary["attempt"] == 2, summary
    assert [a["state"] for a in summary["attempts"]] == ["lost", "succeeded"], summary
    from airflow_provider_sky.backends.local import LocalBackend

    assert not list(LocalBackend(sky_home).records_dir.glob("*.json"))  # the down task removed the cluster
    assert not job_processes(sky_home)
