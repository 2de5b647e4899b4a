"""Clusters shared by runs (leases), teardown of nodes that do not answer, and paths that leave a home.

Real local-backend processes and real sshd hosts on loopback (``tests/support/sshd.py``); nothing is mocked.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pendulum
import pytest
from leaks import job_processes
from sshd import SSHDCluster, _descendants, needs_sshd, user_processes

from airflow_provider_sky.backends.base import Backend, BackendError, Teardown
from airflow_provider_sky.backends.headrecord import record_path
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.backends.ssh import SSHBackend
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import SpecError, TaskSpec, load_task_yaml, task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.loop import watch

LONG = task_from_args(num_nodes=2, run="sleep 10000")
SHORT = task_from_args(num_nodes=2, run="echo short")
A, B = "train/scheduled__2026-01-01T00:00:00+00:00", "train/manual__2026-01-01T00:05:00+00:00"


def _states(client: GangClient, job_id: str) -> list[str]:
    return [r.state for r in client.poll(job_id).status.ranks]


def _wait_done(client: GangClient, job_id: str, timeout: float = 60) -> Any:
    async def go() -> Any:
        last = None
        async for poll in watch(client, job_id, poll_interval=0.2):
            last = poll
        return last

    return asyncio.run(asyncio.wait_for(go(), timeout))


def _wait_running(client: GangClient, job_id: str, n: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while _states(client, job_id) != ["running"] * n:
        assert time.monotonic() < deadline, _states(client, job_id)
        time.sleep(0.1)


def _local_record(sky_home: Path, name: str) -> dict[str, Any] | None:
    path = LocalBackend(sky_home).records_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _two_runs_share_one_cluster(b: Backend, name: str) -> tuple[GangClient, Teardown]:
    """Run A (long) and run B (short) on one cluster; B's teardown must keep it for A."""
    ha = b.provision(name, LONG, holder=A)
    long = GangClient(b, ha)
    long.launch(LONG, "job-a")
    _wait_running(long, "job-a", 2)
    hb = b.provision(name, SHORT, holder=B)  # reused: same nodes, same rank order
    assert hb.ips == ha.ips
    short = GangClient(b, hb)
    short.launch(SHORT, "job-b")
    assert [r.state for r in _wait_done(short, "job-b").status.ranks] == ["succeeded"] * 2
    kept = b.terminate(name, grace=1.0, holder=B)
    assert kept == Teardown(removed=False, kept_for=(A,))
    time.sleep(0.5)
    assert _states(long, "job-a") == ["running", "running"]  # nothing of run A was killed
    return long, kept


# ------------------------------------------------------------------------------------------- local backend


def test_two_runs_on_one_local_cluster_the_last_teardown_removes_it(sky_home: Path) -> None:
    b = LocalBackend(sky_home)
    long, _ = _two_runs_share_one_cluster(b, "shared")
    rec = _local_record(sky_home, "shared")
    assert rec is not None and list(rec["leases"]) == [A]
    assert rec["leases"][A]["holder"] == A and rec["leases"][A]["since"]
    assert job_processes(sky_home)  # run A's ranks still run
    gone = b.terminate("shared", grace=1.0, holder=A)
    assert gone == Teardown(removed=True)
    assert _local_record(sky_home, "shared") is None and b.find("shared") is None
    assert not (sky_home / "local" / "shared").exists()
    assert not job_processes(sky_home)
    assert b.terminate("shared", holder=A) == Teardown(removed=False)  # already gone: not an error


def test_leases_are_kept_per_holder_and_a_forced_teardown_ignores_them(sky_home: Path) -> None:
    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=1, run="true")
    b.provision("c", spec, holder=A)
    first = _local_record(sky_home, "c")
    b.provision("c", spec, holder=A)  # a retry of the same run keeps its lease (and its start)
    assert _local_record(sky_home, "c") == first
    b.provision("c", spec, holder=B)
    # a run that holds no lease (its provision failed, or a manual teardown) never removes another's
    assert b.terminate("c", holder="other/run") == Teardown(removed=False, kept_for=(A, B))
    assert b.terminate("c", holder="") == Teardown(removed=False, kept_for=(A, B))
    assert b.terminate("c") == Teardown(removed=True)  # holder=None: forced
    assert b.find("c") is None


def test_a_local_teardown_that_cannot_write_the_record_deletes_nothing(sky_home: Path) -> None:
    """Run A's teardown sees run B's lease but cannot write the record: it deletes nothing, kills
    nothing and says so (the cluster is kept for the next teardown), rather than failing unexplained."""
    b = LocalBackend(sky_home)
    h = b.provision("c", LONG, holder=A)
    GangClient(b, h).launch(LONG, "job-a")
    b.provision("c", LONG, holder=B)
    before = _local_record(sky_home, "c")
    blocker = b.records_dir / "c.tmp"  # where the new record is written first: a directory cannot be
    blocker.mkdir()
    try:
        with pytest.raises(BackendError, match=r"could not update the record.*nothing was deleted"):
            b.terminate("c", grace=0.5, holder=A)
        assert _local_record(sky_home, "c") == before  # both leases still there
        assert _states(GangClient(b, h), "job-a") == ["running", "running"]
        with pytest.raises(BackendError, match=r"nothing was deleted"):
            b.terminate("c", grace=0.5)  # forced: the same
        assert _states(GangClient(b, h), "job-a") == ["running", "running"]
    finally:
        blocker.rmdir()
    assert b.terminate("c", grace=0.5, holder=A) == Teardown(removed=False, kept_for=(B,))
    assert b.terminate("c", grace=0.5, holder=B) == Teardown(removed=True)
    assert not job_processes(sky_home)


def test_concurrent_provisions_all_get_their_lease(sky_home: Path) -> None:
    b = LocalBackend(sky_home)
    holders = [f"dag/run-{i}" for i in range(8)]
    spec = task_from_args(num_nodes=2, run="true")
    handles: list[Any] = []
    threads = [
        threading.Thread(
            target=lambda h=h: handles.append(LocalBackend(sky_home).provision("c", spec, holder=h))
        )
        for h in holders
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({tuple(h.ips) for h in handles}) == 1  # one cluster, not eight
    rec = _local_record(sky_home, "c")
    assert rec is not None and sorted(rec["leases"]) == sorted(holders)
    for h in holders[:-1]:
        assert not b.terminate("c", holder=h).removed
    assert b.terminate("c", holder=holders[-1]).removed


def test_provision_during_a_teardown_waits_and_gets_a_fresh_cluster(sky_home: Path) -> None:
    b = LocalBackend(sky_home)
    stubborn = task_from_args(num_nodes=2, run="trap '' TERM; sleep 10000")  # dies only at the SIGKILL
    h = b.provision("c", stubborn, holder=A)
    c = GangClient(b, h)
    c.launch(stubborn, "job")
    _wait_running(c, "job", 2)
    done: list[tuple[float, Teardown]] = []
    t = threading.Thread(target=lambda: done.append((time.monotonic(), b.terminate("c", 2.0, holder=A))))
    t.start()
    deadline = time.monotonic() + 10
    while not (_local_record(sky_home, "c") or {}).get("down"):  # the teardown has begun
        assert time.monotonic() < deadline
        time.sleep(0.02)
    again = LocalBackend(sky_home).provision("c", task_from_args(num_nodes=2, run="true"), holder=B)
    provisioned = time.monotonic()
    t.join()
    assert done[0][1] == Teardown(removed=True)
    assert provisioned >= done[0][0]  # it waited for the teardown instead of reusing a dying cluster
    rec = _local_record(sky_home, "c")
    assert rec is not None and list(rec["leases"]) == [B] and "down" not in rec
    assert all(Path(n.home).is_dir() for n in again.nodes)
    assert b.terminate("c", holder=B).removed


def _dag_context(dag_id: str, run_id: str) -> dict[str, Any]:
    from airflow.sdk import DAG

    dag = DAG(dag_id, schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"))
    return {"dag": dag, "run_id": run_id}


def test_down_tasks_of_two_runs_keep_the_cluster_for_the_other(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from airflow_provider_sky.operators.cluster import SkyClusterOperator
    from airflow_provider_sky.operators.down import SkyDownOperator

    kw: dict[str, Any] = {"cluster_name": "shared", "sky_conn_id": None}
    cluster = SkyClusterOperator(task_id="cluster", num_nodes=2, run="sleep 10000", **kw)
    down = SkyDownOperator(task_id="down", grace=1.0, **kw)
    run_a, run_b = _dag_context("train", "run_a"), _dag_context("train", "run_b")
    handle = cluster.execute(run_a)
    cluster.execute(run_b)
    rec = _local_record(sky_home, "shared")
    assert rec is not None and sorted(rec["leases"]) == ["train/run_a", "train/run_b"]
    long = LocalBackend(sky_home)
    c = GangClient(long, long.find("shared"))  # type: ignore[arg-type]
    c.launch(LONG, "job-a")
    _wait_running(c, "job-a", 2)
    assert down.execute(run_b) is False
    assert "Cluster shared kept: still used by run train/run_a" in "".join(capfd.readouterr())
    assert _states(c, "job-a") == ["running", "running"]
    assert down.execute(run_a) is True
    assert LocalBackend(sky_home).find("shared") is None and not job_processes(sky_home)
    assert handle["name"] == "shared"


def test_a_manual_teardown_respects_leases_unless_forced(sky_home: Path) -> None:
    from airflow_provider_sky.hooks.sky import SkyHook

    hook = SkyHook(None)
    hook.provision("c", task_from_args(num_nodes=1, run="true"), holder=A)
    assert hook.teardown("c") == Teardown(removed=False, kept_for=(A,))
    assert hook.teardown("c", force=True) == Teardown(removed=True)
    assert hook.teardown("c") == Teardown(removed=False)


def test_a_failed_cluster_task_leaves_the_cluster_to_the_run_using_it(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Run B's setup fails: its own down-on-failure releases only B's lease; run A keeps running."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_sky.operators.cluster import SkyClusterOperator

    class TI:
        dag_id, task_id, map_index, try_number = "train", "cluster", -1, 1

        def __init__(self, run_id: str) -> None:
            self.run_id = run_id

    ok = SkyClusterOperator(task_id="cluster", cluster_name="c", num_nodes=2, run="true", sky_conn_id=None)
    bad = SkyClusterOperator(
        task_id="cluster", cluster_name="c", num_nodes=2, run="true", setup="exit 3", sky_conn_id=None
    )
    ok.execute({**_dag_context("train", "run_a"), "ti": TI("run_a")})
    b = LocalBackend(sky_home)
    c = GangClient(b, b.find("c"))  # type: ignore[arg-type]
    c.launch(LONG, "job-a")
    _wait_running(c, "job-a", 2)
    with pytest.raises(AirflowFailException, match="FAILED_SETUP"):
        bad.execute({**_dag_context("train", "run_b"), "ti": TI("run_b")})
    assert "Cluster c kept: still used by run train/run_a" in "".join(capfd.readouterr())
    rec = _local_record(sky_home, "c")
    assert rec is not None and list(rec["leases"]) == ["train/run_a"]
    assert _states(c, "job-a") == ["running", "running"]
    assert b.terminate("c", holder="train/run_a").removed and not job_processes(sky_home)


def test_default_cluster_of_a_run_is_its_own(sky_home: Path) -> None:
    """Two DAGs whose slugs collide, same run id: two clusters, and one's down leaves the other."""
    from airflow_provider_sky.operators.cluster import SkyClusterOperator
    from airflow_provider_sky.operators.down import SkyDownOperator

    run = "scheduled__2026-01-01T00:00:00+00:00"
    ctx1, ctx2 = _dag_context("adv_collide_A", run), _dag_context("adv-collide-a", run)
    op = SkyClusterOperator(task_id="cluster", num_nodes=1, run="true", sky_conn_id=None)
    one, two = op.execute(ctx1)["name"], op.execute(ctx2)["name"]
    assert one != two
    assert SkyDownOperator(task_id="down", sky_conn_id=None).execute(ctx1) is True
    assert LocalBackend(sky_home).find(two) is not None
    assert SkyDownOperator(task_id="down", sky_conn_id=None).execute(ctx2) is True


def test_a_spec_the_backend_refuses_fails_the_cluster_task_without_retries(
    sky_home: Path, tmp_path: Path
) -> None:
    """A missing source is found before anything is provisioned, and no retry can fix it: the task fails
    for good (AirflowFailException) instead of spending its retries on the same error."""
    from airflow.sdk.exceptions import AirflowFailException

    from airflow_provider_sky.operators.cluster import SkyClusterOperator

    op = SkyClusterOperator(
        task_id="cluster",
        num_nodes=2,
        run="true",
        sky_conn_id=None,
        retries=3,
        file_mounts={"~/data": str(tmp_path / "missing")},
    )
    with pytest.raises(AirflowFailException, match=r"file_mounts\.~/data"):
        op.execute(_dag_context("spec_fail", "manual__1"))
    assert not list((sky_home / "local").glob("*/node-0")), "nothing may be provisioned"


# ------------------------------------------------------------------------------------------- paths


def test_dotdot_file_mount_writes_nothing_outside_the_home(sky_home: Path, tmp_path: Path) -> None:
    src = tmp_path / "payload"
    src.write_text("x\n")
    yaml_path = tmp_path / "task.yaml"
    yaml_path.write_text(f"num_nodes: 2\nrun: 'true'\nfile_mounts:\n  ~/../../../../escape: {src}\n")
    with pytest.raises(SpecError, match=r"file_mounts\.~/\.\./\.\./\.\./\.\./escape.*'\.\.'"):
        load_task_yaml(yaml_path)
    with pytest.raises(SpecError, match=r"file_mounts\.~/\.\./escape"):
        task_from_args(num_nodes=2, run="true", file_mounts={"~/../escape": str(src)})
    # defence in depth: a spec built without the parser still cannot write outside a node's home
    b = LocalBackend(sky_home)
    raw = TaskSpec(run="true", num_nodes=2, file_mounts={"~/../../escape": str(src)})
    h = b.provision("paths", raw)
    with pytest.raises(SpecError, match=r"file_mounts\.~/\.\./\.\./escape.*outside"):
        b.sync_files(h, raw)
    assert (Path(h.nodes[0].home) / ".." / ".." / "escape").resolve() == sky_home / "local" / "escape"
    assert not list(sky_home.rglob("escape")) and not list(tmp_path.rglob("escape"))
    b.terminate("paths")


def test_file_mount_through_a_symlink_out_of_the_home_is_refused(sky_home: Path, tmp_path: Path) -> None:
    src = tmp_path / "payload"
    src.write_text("x\n")
    outside = tmp_path / "outside"
    outside.mkdir()
    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=1, run="true", file_mounts={"~/link/x": str(src)})
    h = b.provision("link", spec)
    (Path(h.nodes[0].home) / "link").symlink_to(outside)  # e.g. left there by an earlier setup
    with pytest.raises(SpecError, match=r"file_mounts\.~/link/x"):
        b.sync_files(h, spec)
    assert list(outside.iterdir()) == []
    b.terminate("link")


# ------------------------------------------------------------------------------------------- SSH hosts


def _ssh_args(c: SSHDCluster) -> dict[str, Any]:
    return {
        "user": "",
        "key_file": c.client_key_path,
        "known_hosts": c.known_hosts_path,
        "connect_timeout": 2.0,
        "ready_timeout": 5.0,
    }


def _ssh(c: SSHDCluster, **kw: Any) -> SSHBackend:
    return SSHBackend(c.host_list(), **{**_ssh_args(c), **kw})


def _head_record(c: SSHDCluster, name: str) -> dict[str, Any] | None:
    path = Path(c.nodes[0].home, record_path(name))
    return json.loads(path.read_text()) if path.exists() else None


def _sleepers(c: SSHDCluster) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for n in c.nodes:
        for pid in user_processes(n.user):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"sleep\x0010000" in cmd:
                out.setdefault(n.index, []).append(pid)
    return out


@pytest.fixture(scope="module")
def hosts3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHDCluster]:
    if os.geteuid() != 0 or not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("needs root and openssh-server")
    with SSHDCluster(3, tmp_path_factory.mktemp("sshd-leases")) as c:
        yield c
        ssh.close_all()


@needs_sshd
def test_two_runs_on_one_ssh_cluster_the_last_teardown_removes_it(hosts3: SSHDCluster) -> None:
    b = _ssh(hosts3)
    _two_runs_share_one_cluster(b, "shared")
    rec = _head_record(hosts3, "shared")
    assert rec is not None and list(rec["leases"]) == [A]
    assert sorted(_sleepers(hosts3)) == [0, 1]
    assert b.terminate("shared", grace=1.0, holder=A) == Teardown(removed=True)
    assert _head_record(hosts3, "shared") is None and _sleepers(hosts3) == {}
    assert b.terminate("shared", holder=A) == Teardown(removed=False)


@needs_sshd
@pytest.mark.parametrize("lock", ["auto", "mkdir"])
def test_concurrent_ssh_provisions_all_get_their_lease(hosts3: SSHDCluster, lock: str) -> None:
    holders = [f"dag/run-{i}" for i in range(6)]
    spec = task_from_args(num_nodes=3, run="true")
    errors: list[BaseException] = []

    def one(holder: str) -> None:
        b = _ssh(hosts3)
        b.record_lock = lock
        try:
            b.provision("many", spec, holder=holder)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(h,)) for h in holders]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    rec = _head_record(hosts3, "many")
    assert rec is not None and sorted(rec["leases"]) == sorted(holders)
    b = _ssh(hosts3)
    b.record_lock = lock
    results = []
    threads = [
        threading.Thread(target=lambda h=h: results.append(b.terminate("many", 1.0, holder=h)))
        for h in holders
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r.removed for r in results) == 1  # exactly the last holder removed it
    assert _head_record(hosts3, "many") is None
    assert not list(Path(hosts3.nodes[0].home, record_path("many")).parent.glob(".lock*/*"))


@needs_sshd
def test_an_ssh_cluster_named_like_an_internal_directory_leaves_the_other_records_alone(
    hosts3: SSHDCluster,
) -> None:
    """A node's runtime is ``~/.sky_airflow/<cluster>`` and the head's records are kept apart from every
    name a cluster can have: the teardown of a cluster named ``clusters`` once removed the records of
    every cluster on that head, whose ranks then ran on with no teardown able to find them."""
    b = _ssh(hosts3)
    h = b.provision("train", LONG)
    train = GangClient(b, h)
    train.launch(LONG, "job-a")
    _wait_running(train, "job-a", 2)
    other = b.provision("clusters", task_from_args(num_nodes=3, run="true"))
    GangClient(b, other).launch(task_from_args(num_nodes=3, run="true"), "job-c")
    assert b.terminate("clusters", grace=0.5).removed
    assert _head_record(hosts3, "train") is not None, "the teardown of 'clusters' took the record of 'train'"
    assert _states(train, "job-a") == ["running", "running"]
    assert b.terminate("train", grace=0.5) == Teardown(removed=True)
    assert _sleepers(hosts3) == {}


@needs_sshd
def test_an_ssh_teardown_that_cannot_write_the_record_deletes_nothing(hosts3: SSHDCluster) -> None:
    """Run A's teardown sees run B's lease, but the head's record lock is held (a stuck writer): the
    record cannot be updated, so nothing is killed or removed on any node and the error says so."""
    import fcntl

    b = _ssh(hosts3)
    b.record_lock_wait = 2.0
    h = b.provision("locked", LONG, holder=A)
    GangClient(b, h).launch(LONG, "job-a")
    _wait_running(GangClient(b, h), "job-a", 2)
    b.provision("locked", LONG, holder=B)
    before = _head_record(hosts3, "locked")
    lock = Path(hosts3.nodes[0].home, record_path("locked")).parent / ".lock"
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(BackendError, match=r"could not update.*nothing was deleted"):
            b.terminate("locked", grace=0.5, holder=A)
        with pytest.raises(BackendError, match=r"nothing was deleted"):
            b.terminate("locked", grace=0.5)  # forced: the same
    assert _head_record(hosts3, "locked") == before  # both leases still there
    assert sorted(_sleepers(hosts3)) == [0, 1]  # and both of run A's ranks run on
    assert b.terminate("locked", grace=0.5, holder=A) == Teardown(removed=False, kept_for=(B,))
    assert b.terminate("locked", grace=0.5, holder=B) == Teardown(removed=True)
    assert _sleepers(hosts3) == {}


@needs_sshd
def test_an_ssh_teardown_whose_head_is_unreachable_deletes_nothing(hosts3: SSHDCluster) -> None:
    """The record (its nodes, its leases) is on the head: a teardown that cannot reach the head cannot
    know who holds the cluster, so it kills nothing on the other nodes and says so."""
    b = _ssh(hosts3)
    h = b.provision("headless", LONG, holder=A)
    GangClient(b, h).launch(LONG, "job-a")
    _wait_running(GangClient(b, h), "job-a", 2)
    hosts3.kill_node(0)  # the head (and rank 0 with it) is gone
    try:
        with pytest.raises(BackendError, match=r"nothing was deleted"):
            b.terminate("headless", grace=0.5, holder=A)
        assert sorted(_sleepers(hosts3)) == [1]  # rank 1 runs on, on its own host
    finally:
        hosts3.restart_node(0)
        ssh.close_all()
    b = _ssh(hosts3)
    assert b.terminate("headless", grace=0.5, holder=A) == Teardown(removed=True)
    assert _sleepers(hosts3) == {}


@needs_sshd
def test_one_cluster_name_on_two_heads_is_refused_on_a_shared_host(hosts3: SSHDCluster) -> None:
    """Two connections share a host but have different heads (so different record stores): a cluster
    name in use on that host by one is refused by the other, which would share its directory and
    whose teardown would kill the first one's ranks."""
    first = _ssh(hosts3)  # head: node 0; the cluster takes nodes 0 and 1
    h = first.provision("same", LONG, holder=A)
    GangClient(first, h).launch(LONG, "job-a")
    _wait_running(GangClient(first, h), "job-a", 2)
    second = SSHBackend(hosts3.host_list()[1:], **_ssh_args(hosts3))  # head: node 1
    with pytest.raises(BackendError, match=rf"cluster 'same'.*{hosts3.nodes[1].host}:{hosts3.nodes[1].port}"):
        second.provision("same", LONG, holder=B)
    assert second.find("same") is None  # nothing recorded on its head
    assert not Path(hosts3.nodes[2].home, ".sky_airflow", "same").exists()  # nor left on its other host
    assert second.terminate("same", grace=0.5) == Teardown(removed=False)
    assert sorted(_sleepers(hosts3)) == [0, 1]  # the first cluster's ranks run on
    assert first.terminate("same", grace=0.5, holder=A) == Teardown(removed=True)
    assert _sleepers(hosts3) == {}
    again = second.provision("same", task_from_args(num_nodes=2, run="true"))  # free once it is gone
    assert second.terminate(again.name, grace=0.5).removed


@needs_sshd
def test_an_ssh_teardown_leaves_a_directory_another_cluster_owns(hosts3: SSHDCluster) -> None:
    """A node directory whose owner is another cluster of the same name (another head) is not this
    cluster's to kill or remove: the teardown leaves it and keeps the node in the record, unclean."""
    b = _ssh(hosts3)
    h = b.provision("owned", LONG)
    GangClient(b, h).launch(LONG, "job-a")
    _wait_running(GangClient(b, h), "job-a", 2)
    root = Path(hosts3.nodes[1].home, ".sky_airflow", "owned")
    mine = (root / ".owner").read_text()
    (root / ".owner").write_text("someone@10.9.9.9:22 owned\n")
    try:
        result = b.terminate("owned", grace=0.5)
        assert not result.removed and len(result.unclean) == 1
        assert "another cluster of this name" in result.unclean[0] and "10.9.9.9" in result.unclean[0]
        assert sorted(_sleepers(hosts3)) == [1] and root.exists()  # node 0 cleaned, node 1 untouched
    finally:
        (root / ".owner").write_text(mine)
    assert b.terminate("owned", grace=0.5) == Teardown(removed=True)  # ours again: finished
    assert _sleepers(hosts3) == {} and not root.exists()


def _hang(c: SSHDCluster, i: int) -> list[int]:
    """A hung node: its sshd and every SSH session on it stopped (SIGSTOP); its ranks keep running."""
    proc = c.nodes[i].proc
    assert proc is not None
    pids = [proc.pid, *_descendants(proc.pid)]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    return pids


def _resume(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@needs_sshd
def test_a_hung_node_keeps_the_record_and_a_later_teardown_finishes(
    hosts3: SSHDCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from airflow.sdk.exceptions import AirflowException

    from airflow_provider_sky.operators.down import SkyDownOperator

    conn = {
        "conn_type": "sky_ssh",
        "host": ",".join(hosts3.host_list()),
        "extra": {
            "key_file": hosts3.client_key_path,
            "known_hosts": hosts3.known_hosts_path,
            "connect_timeout": 2,
            "ready_timeout": 5,
        },
    }
    monkeypatch.setenv("AIRFLOW_CONN_SKY_HANG", json.dumps(conn))
    ctx = _dag_context("hang", "run_1")
    b = _ssh(hosts3)
    spec = task_from_args(num_nodes=3, run="sleep 10000")
    c = GangClient(b, b.provision("hang", spec, holder="hang/run_1"))
    c.launch(spec, "job")
    _wait_running(c, "job", 3)
    stopped = _hang(hosts3, 1)
    try:
        down = SkyDownOperator(task_id="down", cluster_name="hang", sky_conn_id="sky_hang", grace=1.0)
        t = time.monotonic()
        with pytest.raises(AirflowException) as err:
            down.execute(ctx)
        took = time.monotonic() - t
        msg = str(err.value)
        print(f"\nteardown with a hung node (connect_timeout 2s): {took:.1f}s\n{msg}")
        assert hosts3.nodes[1].host in msg and hosts3.nodes[0].host not in msg
        assert "clear" in msg and ".teardown('hang')" in msg
        assert took < 20, f"teardown of a hung node took {took:.1f}s"  # bounded by the connect timeout
        rec = _head_record(hosts3, "hang")
        assert rec is not None and list(rec["unclean"]) == ["node-1"]
        assert sorted(_sleepers(hosts3)) == [1]  # the answering nodes were cleaned
        with pytest.raises(BackendError, match=r"teardown to finish.*127\.0\.\d+\.2"):
            _ssh(hosts3).provision("hang", spec, holder="hang/run_2")  # never reused half torn down
    finally:
        _resume(stopped)
    assert sorted(_sleepers(hosts3)) == [1]  # the node is back and its rank still runs
    assert down.execute(ctx) is True  # the cleared down task finishes the work
    assert _head_record(hosts3, "hang") is None
    assert _sleepers(hosts3) == {}
    assert not Path(hosts3.nodes[1].home, ".sky_airflow", "hang").exists()
    ssh.close_all()
