"""Gangs over SSH on real sshd hosts (127.0.k.x, each its own user, home and host key)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sshd import SSHDCluster, needs_sshd, user_processes

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.headrecord import record_path
from airflow_provider_sky.backends.ssh import SSHBackend
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.loop import watch

pytestmark = needs_sshd


def _backend(c: SSHDCluster, **kw: Any) -> SSHBackend:
    return c.ssh_backend(**kw)


def _user_procs(c: SSHDCluster, pattern: str) -> list[int]:
    out = []
    for n in c.nodes:
        for pid in user_processes(n.user):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if pattern in cmd:
                out.append(pid)
    return out


@pytest.fixture(scope="module")
def hosts4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHDCluster]:
    with SSHDCluster(4, tmp_path_factory.mktemp("sshd4")) as c:
        yield c
        ssh.close_all()
        _assert_nothing_left(c)


def _assert_nothing_left(c: SSHDCluster) -> None:
    """No process of the hosts' users (ranks, sessions) outlives the tests that used them."""
    deadline = time.time() + 10
    while time.time() < deadline and any(user_processes(n.user) for n in c.nodes):
        time.sleep(0.1)
    assert {n.user: user_processes(n.user) for n in c.nodes if user_processes(n.user)} == {}


def _wait(client: GangClient, job_id: str, timeout: float = 60, **kw: Any) -> Any:
    async def go() -> Any:
        last = None
        async for poll in watch(client, job_id, poll_interval=0.2, **kw):
            last = poll
        return last

    return asyncio.run(asyncio.wait_for(go(), timeout))


def test_gang_on_4_hosts_each_rank_is_its_own_host(hosts4: SSHDCluster) -> None:
    b = _backend(hosts4)
    spec = task_from_args(num_nodes=4, run='echo "$(whoami) $(cat ~/node) $SKYPILOT_NODE_RANK $MASTER_ADDR"')
    h = b.provision("g4", spec)
    assert h.ips == [n.host for n in hosts4.nodes]  # head first, workers sorted numerically
    c = GangClient(b, h)
    c.launch(spec, "job")
    poll = _wait(c, "job")
    assert [r.state for r in poll.status.ranks] == ["succeeded"] * 4
    for rank, node in enumerate(hosts4.nodes):
        out = c.poll("job").chunks[rank][1].decode().split()
        assert out == [node.user, str(node.index), str(rank), hosts4.nodes[0].host]
    assert b.terminate("g4").removed is True
    assert b.find("g4") is None
    assert b.terminate("g4").removed is False


def test_rank_order_is_numeric_and_stable_on_reuse(hosts4: SSHDCluster) -> None:
    hosts = hosts4.host_list()
    shuffled = [hosts[0], *random.sample(hosts[1:], 3)]
    b = _backend(hosts4, hosts=shuffled)
    spec = task_from_args(num_nodes=4, run="true")
    first = b.provision("order", spec).ips
    assert first == [n.host for n in hosts4.nodes]
    again = _backend(hosts4, hosts=[hosts[0], *reversed(hosts[1:])]).provision("order", spec).ips
    assert again == first
    b.terminate("order")


def test_fail_fast_on_ssh(hosts4: SSHDCluster) -> None:
    b = _backend(hosts4)
    run = 'if [ "$SKYPILOT_NODE_RANK" == "2" ]; then sleep 1; exit 1; fi; sleep 10000'
    spec = task_from_args(num_nodes=4, run=run)
    c = GangClient(b, b.provision("ff", spec))
    c.launch(spec, "job")
    poll = _wait(c, "job")
    assert {r.rank: r.state for r in poll.status.ranks} == {
        0: "cancelled",
        1: "cancelled",
        2: "failed",
        3: "cancelled",
    }
    assert f"rank 2 ({hosts4.nodes[2].host}) exited with code 1" in poll.status.failure_message()
    assert _user_procs(hosts4, "sleep 10000") == []
    b.terminate("ff")


def test_workdir_is_copied_and_rank_runs_there(hosts4: SSHDCluster, tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "train.sh").write_text('echo "trained on $(cat ~/node)"\n')
    (wd / "train.sh").chmod(0o755)
    b = _backend(hosts4)
    spec = task_from_args(num_nodes=2, run="./train.sh && pwd", workdir=str(wd), setup="test -x train.sh")
    h = b.provision("wd", spec)
    b.sync_files(h, spec)
    c = GangClient(b, h)
    c.launch(spec, "job")
    _wait(c, "job")
    out = c.poll("job").chunks[1][1].decode()
    assert out == f"trained on 1\n{hosts4.nodes[1].home}/sky_workdir\n"
    b.terminate("wd")


def test_node_loss_mid_run_is_reported_lost(tmp_path: Path) -> None:
    with SSHDCluster(3, tmp_path) as c3:
        b = _backend(c3)
        spec = task_from_args(num_nodes=3, run="sleep 10000")
        c = GangClient(b, b.provision("loss", spec))
        c.launch(spec, "job")
        time.sleep(0.5)
        c3.kill_node(1)  # sshd and every process of that node's user
        poll = _wait(c, "job", lost_after=2.0)
        lost = poll.status.by_rank(1)
        assert lost.state == "lost" and c3.nodes[1].host in lost.reason
        assert [poll.status.by_rank(r).state for r in (0, 2)] == ["cancelled", "cancelled"]
        assert "was lost" in poll.status.failure_message()
        assert _user_procs(c3, "sleep 10000") == []
        b.terminate("loss")  # the lost node is skipped with a warning
        ssh.close_all()
        _assert_nothing_left(c3)


def test_host_key_mismatch_is_refused_before_anything_runs(hosts4: SSHDCluster, tmp_path: Path) -> None:
    lines = Path(hosts4.known_hosts_path).read_text().splitlines()
    other = lines[0].split(" ", 1)[1]
    bad = tmp_path / "known_hosts"
    bad.write_text("\n".join([lines[0], lines[1].split(" ")[0] + " " + other, *lines[2:]]) + "\n")
    ssh.close_all()
    b = _backend(hosts4, known_hosts=str(bad))
    with pytest.raises((BackendError, RunnerError), match=r"(?i)host key") as err:
        b.provision("hk", task_from_args(num_nodes=4, run="touch ~/canary"))
    assert hosts4.nodes[1].host in str(err.value)
    for n in hosts4.nodes:
        assert not Path(n.home, ".sky_airflow", "hk").exists()
    ssh.close_all()


def test_wrong_key_names_host_and_user(hosts4: SSHDCluster, tmp_path: Path) -> None:
    import subprocess

    key = tmp_path / "wrong"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    ssh.close_all()
    b = _backend(hosts4, key_file=str(key))
    with pytest.raises((BackendError, RunnerError)) as err:
        b.provision("auth", task_from_args(num_nodes=4, run="true"))
    assert hosts4.nodes[0].user in str(err.value) and hosts4.nodes[0].host in str(err.value)
    assert "rejected" in str(err.value) or "auth" in str(err.value).lower()
    assert "PRIVATE KEY" not in str(err.value)
    ssh.close_all()


def test_the_test_button_reaches_every_host_and_names_the_one_that_fails(
    hosts4: SSHDCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection form's Test button (Airflow calls the hook's ``test_connection``): handshake, host
    key and login on every host, nothing run on any of them."""
    import json
    import subprocess

    from airflow_provider_sky.hooks.sky import SkySSHHook  # type: ignore[attr-defined]

    ssh.close_all()
    monkeypatch.setenv("AIRFLOW_CONN_SKY_T", hosts4.sky_ssh_connection())
    ok, message = SkySSHHook("sky_t").test_connection()
    assert ok, message
    assert "4 hosts reachable" in message
    key = tmp_path / "wrong"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    conn = json.loads(hosts4.sky_ssh_connection())
    conn["extra"]["key_file"] = str(key)
    conn["host"] += f",{hosts4.nodes[0].user}@127.0.0.254:{hosts4.nodes[0].port}"
    conn["extra"]["connect_timeout"] = 1
    monkeypatch.setenv("AIRFLOW_CONN_SKY_T", json.dumps(conn))
    ok, message = SkySSHHook("sky_t").test_connection()
    assert not ok
    assert "5 of 5 hosts failed" in message and "127.0.0.254" in message, message
    assert hosts4.nodes[0].user in message and "PRIVATE KEY" not in message
    for n in hosts4.nodes:  # nothing ran: no runtime directory was made
        assert not Path(n.home, ".sky_airflow").exists() or not list(Path(n.home, ".sky_airflow").glob("t*"))
    ssh.close_all()


def test_unreachable_host_fails_after_readiness_timeout(hosts4: SSHDCluster) -> None:
    hosts = [*hosts4.host_list()[:2], f"{hosts4.nodes[2].user}@127.0.0.254:{hosts4.nodes[0].port}"]
    b = _backend(hosts4, hosts=hosts, ready_timeout=1.0)
    t = time.monotonic()
    with pytest.raises(BackendError, match=r"127\.0\.0\.254.*within 1s"):
        b.provision("unreach", task_from_args(num_nodes=3, run="sleep 10000"))
    assert time.monotonic() - t < 15
    assert _user_procs(hosts4, "sleep 10000") == []


def test_too_many_nodes_for_the_hosts_is_clear(hosts4: SSHDCluster) -> None:
    with pytest.raises(BackendError, match="asks for 5 nodes but the SSH connection has 4 hosts"):
        _backend(hosts4).provision("big", task_from_args(num_nodes=5, run="true"))


def test_16_hosts_gang_and_fail_fast(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with SSHDCluster(16, tmp_path) as c16:
        b = _backend(c16)
        ok = task_from_args(num_nodes=16, run='echo "r$SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES"')
        c = GangClient(b, b.provision("g16", ok))
        c.launch(ok, "hello")
        poll = _wait(c, "hello")
        assert [r.state for r in poll.status.ranks] == ["succeeded"] * 16
        run = 'if [ "$SKYPILOT_NODE_RANK" = "7" ]; then sleep 1; exit 3; fi; sleep 10000'
        bad = task_from_args(num_nodes=16, run=run)
        c.launch(bad, "ff")
        poll = _wait(c, "ff")
        failed_at = poll.status.by_rank(7).end
        while _user_procs(c16, "sleep 10000"):
            time.sleep(0.01)
        gone = time.time()
        assert poll.status.root_cause().rank == 7  # type: ignore[union-attr]
        assert sum(r.state == "cancelled" for r in poll.status.ranks) == 15
        with capsys.disabled():
            print(f"\n16 SSH hosts: rank exit -> last sibling gone {gone - failed_at:.2f}s")
        assert gone - failed_at < 10
        b.terminate("g16")
        ssh.close_all()
        _assert_nothing_left(c16)


def test_examples_under_dag_test_on_the_ssh_cluster(
    hosts4: SSHDCluster, airflow_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Example DAGs under ``dag.test()`` with ``sky_default`` pointing at the SSH hosts: the operators and the
    triggers share one process (and its SSH connections), a success and a fail-fast whose siblings end on
    every host. Every example runs on these hosts under a real scheduler in ``test_airflow_real[ssh]``."""
    from integration.test_dag_test import _run, _states

    monkeypatch.setenv("AIRFLOW_CONN_SKY_DEFAULT", hosts4.sky_ssh_connection())
    dr, tis = _run("sky_hello")
    assert str(dr.state) == "success" and set(_states(tis, "rank").values()) == {"success"}
    dr, tis = _run("sky_fail_fast")
    assert str(dr.state) == "failed" and tis[("down", -1)].state == "success"
    assert _user_procs(hosts4, "sleep 10000") == []
    for n in hosts4.nodes:  # every cluster was torn down
        assert not list(Path(n.home, ".sky_airflow").glob("sky-*"))
    ssh.close_all()


def test_each_hosts_result_file_is_read_from_its_own_home_masked(hosts4: SSHDCluster) -> None:
    """A gang's result on SSH hosts: ``~/`` is each host user's home, the file is masked like the log,
    and the default is rank 0's last line (``airflow_provider_sky.watch.result``)."""
    from airflow_provider_sky.watch.jobs import run_sync
    from airflow_provider_sky.watch.result import read_result, result_config

    b = _backend(hosts4)
    run = 'mkdir -p ~/out; printf "%s %s" "$(cat ~/node)" "$TOKEN" > ~/out/r.txt; echo "last $SKYPILOT_NODE_RANK"'
    spec = task_from_args(num_nodes=2, run=run, secrets={"TOKEN": "s3cr3t-value"}, result_file="~/out/r.txt")
    c = GangClient(b, b.provision("res", spec))
    try:
        c.launch(spec, "job")
        status = _wait(c, "job").status
        assert status.succeeded
        nodes = [str(n.index) for n in hosts4.nodes[:2]]
        got = run_sync(read_result(c, status, result_config("all", None, 1000)))
        assert got == [f"{nodes[0]} ***", f"{nodes[1]} ***"]
        plain = task_from_args(num_nodes=2, run=run)  # no result_file: the last output line
        c.launch(plain, "job2")
        status2 = _wait(c, "job2").status
        assert run_sync(read_result(c, status2, result_config(0, None, 1000))) == "last 0"
    finally:
        c.close()
        assert b.terminate("res").removed is True


def test_a_status_call_writing_during_the_teardown_does_not_keep_the_cluster(hosts4: SSHDCluster) -> None:
    """A watcher's status call that began before the teardown can still write into its rank's directory
    (``status.sh`` notes ``polled``; a watcher that gave up on a call does not wait for the remote
    script's end). Such a write into a directory that ``rm -rf`` is emptying failed the removal, so the
    head kept the node as unclean with the record and the root left behind. The teardown is clean,
    and nothing of the cluster is left, while a writer keeps writing there until the directory is gone."""
    b = _backend(hosts4)
    spec = task_from_args(num_nodes=2, run="true")
    handle = b.provision("late", spec)
    c = GangClient(b, handle)
    try:
        c.launch(spec, "job")
        assert _wait(c, "job").status.succeeded
    finally:
        c.close()
    rank_dir = Path(handle.nodes[0].root) / "jobs" / "job" / "0"
    assert rank_dir.is_dir()
    # what status.sh does (`printf ... > "$d/polled"`), as often as the shell can, until the directory is gone
    writer = subprocess.Popen(
        [
            *("runuser", "-u", hosts4.nodes[0].user, "--"),  # as the host's user, as status.sh runs
            "timeout",
            "30",
            "sh",
            "-c",
            'while [ -d "$1" ]; do : > "$1/polled" 2>/dev/null; done',
            "sh",
            str(rank_dir),
        ]
    )
    try:
        down = b.terminate("late")
    finally:
        writer.kill()
        writer.wait()
    assert down.removed and not down.unclean, down
    assert not Path(handle.nodes[0].root).exists()
    assert not Path(hosts4.nodes[0].home, record_path("late")).exists()  # the record on the head went too
