"""The embedded local backend: addresses, stable rank order on reuse, limits, file sync."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from airflow_provider_sky.backends.base import BackendError, choose_resources
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.spec import SpecError, check_backend, task_from_args


def test_nodes_get_their_own_loopback_ip_and_home(sky_home: Path) -> None:
    b = LocalBackend(sky_home)
    h = b.provision("a", task_from_args(num_nodes=3, run="true"))
    assert h.ips == ["127.1.0.1", "127.1.0.2", "127.1.0.3"]
    assert len({n.home for n in h.nodes}) == 3
    other = b.provision("b", task_from_args(num_nodes=2, run="true"))
    assert not set(other.ips) & set(h.ips)
    b.terminate("a")
    b.terminate("b")


def test_a_1024_node_cluster_gets_distinct_addresses_in_rank_order(sky_home: Path) -> None:
    """The old plan (``127.0.<block>.<i+1>``) stopped at 128 nodes; users try 1,024."""
    b = LocalBackend(sky_home)
    h = b.provision("big", task_from_args(num_nodes=1024, run="true"))
    assert len(set(h.ips)) == 1024
    assert h.ips[:2] == ["127.1.0.1", "127.1.0.2"] and h.ips[254] == "127.1.1.1" and h.ips[-1] == "127.1.4.8"
    small = b.provision("small", task_from_args(num_nodes=2, run="true"))
    assert not set(small.ips) & set(h.ips)
    assert b.terminate("big").removed and b.terminate("small").removed


def test_reuse_keeps_rank_order_and_mismatch_is_clear(sky_home: Path) -> None:
    b = LocalBackend(sky_home)
    first = b.provision("a", task_from_args(num_nodes=4, run="true"))
    again = b.provision("a", task_from_args(num_nodes=4, run="echo other"))
    assert again.ips == first.ips and again.nodes[0].ip == first.nodes[0].ip
    with pytest.raises(BackendError, match="exists with 4 nodes.*asks for 2"):
        b.provision("a", task_from_args(num_nodes=2, run="true"))
    b.terminate("a")


def test_backend_limits_are_checked_before_provisioning(sky_home: Path) -> None:
    b = LocalBackend(sky_home, accelerators="")  # a machine without GPUs (see test_accelerators.py for GPUs)
    with pytest.raises(SpecError, match="num_nodes"):
        check_backend(task_from_args(num_nodes=5000, run="true"), b.capabilities)
    with pytest.raises(SpecError, match="this machine has no GPUs .*asks for V100:1 per node"):
        choose_resources(b, task_from_args(num_nodes=1, run="true", resources={"accelerators": "V100:1"}))
    with pytest.raises(SpecError, match="file_mounts"):
        b.provision("x", task_from_args(num_nodes=1, run="true", file_mounts={"/etc/x": str(sky_home)}))
    assert not (sky_home / "local" / "x").exists()


def test_workdir_and_file_mounts_reach_every_node(sky_home: Path, tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    wd.mkdir()
    (wd / "train.py").write_text("print('hi')\n")
    data = tmp_path / "data.txt"
    data.write_text("d\n")
    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=2, run="true", workdir=str(wd), file_mounts={"~/data/d.txt": str(data)})
    h = b.provision("a", spec)
    b.sync_files(h, spec)
    for n in h.nodes:
        assert (Path(n.home) / "sky_workdir" / "train.py").read_text() == "print('hi')\n"
        assert (Path(n.home) / "data" / "d.txt").read_text() == "d\n"
        assert b.workdir(n, spec) == f"{n.home}/sky_workdir"
    b.terminate("a")


def test_a_local_teardown_is_one_call_and_leaves_nothing(sky_home: Path) -> None:
    """Every node is on this machine: one teardown call for all (1,024 calls took 31 s), nothing left."""
    from leaks import job_processes

    from airflow_provider_sky.runners.base import CALLS
    from airflow_provider_sky.watch.jobs import GangClient

    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=64, run="sleep 600 & sleep 600")
    h = b.provision("wide", spec)
    client = GangClient(b, h)
    client.launch(spec, "job", orphan_timeout=0)
    assert all(r.state == "running" for r in client.peek("job").ranks)
    CALLS.reset()
    assert b.terminate("wide", grace=0.5).removed
    assert CALLS.total() == 1
    assert not job_processes(sky_home)
    assert not (sky_home / "local" / "wide").exists()


OTHER_MACHINE = """
import json, sys
from airflow_provider_sky.backends.base import BackendError, ClusterHandle
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.watch.jobs import GangClient

b = LocalBackend(sys.argv[1])
handle = ClusterHandle.from_dict(json.loads(sys.argv[2]))
for what, call in (
    ("status", lambda: GangClient(b, handle).peek("job")),
    ("teardown", lambda: b.terminate(handle.name)),
):
    try:
        call()
        print(what, "WORKED")
    except BackendError as exc:
        print(what, "REFUSED", exc)
"""


def test_a_worker_on_another_machine_is_refused_and_breaks_nothing(sky_home: Path) -> None:
    """Celery workers on several machines sharing the state dir (the worst case: NFS): a poll or a
    teardown from a machine that is not the cluster's says so instead of reporting every rank lost or
    dropping the record of nodes it cannot reach. The other machine is a new UTS namespace with its own
    host name (the same disk: the state dir is shared)."""
    import json
    import subprocess
    import sys

    from gangs import launched

    from airflow_provider_sky.backends.local.backend import this_machine

    b, handle = launched(sky_home, 2, "sleep 30")
    assert {n["extra"]["machine"] for n in handle["nodes"]} == {this_machine()}
    out = subprocess.run(
        ["unshare", "--uts", "--", "sh", "-c", 'hostname sky-other-machine && exec "$@"', "sh"]
        + [sys.executable, "-c", OTHER_MACHINE, str(sky_home), json.dumps(handle)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [["status", "REFUSED"], ["teardown", "REFUSED"]], (
        out.stdout
    )
    for line in lines:
        assert f"provisioned the cluster ({this_machine()})" in line and "sky-other-machine" in line, line
        assert "skyssh" in line, line  # the fix
    # nothing changed: the ranks still run, the record is whole, and this machine's teardown works
    from airflow_provider_sky.backends.base import ClusterHandle
    from airflow_provider_sky.watch.jobs import GangClient

    status = GangClient(b, ClusterHandle.from_dict(handle)).peek("job")
    assert [r.state for r in status.ranks] == ["running", "running"], status
    assert b.terminate(handle["name"]).removed
    assert b.find(handle["name"]) is None


def test_every_rank_gets_its_own_nodes_home(sky_home: Path) -> None:
    """Ranks sharing this machine are started in batches through one node's runner; each must still
    have its own node's home as HOME (a rank writing ``~/x`` must not write into rank 0's home)."""
    from gangs import launched, wait_done

    from airflow_provider_sky.backends.base import ClusterHandle
    from airflow_provider_sky.watch.jobs import GangClient

    b, handle = launched(sky_home, 3, 'echo "$SKYPILOT_NODE_RANK" > "$HOME/who"')
    assert wait_done(GangClient(b, ClusterHandle.from_dict(handle))).status.succeeded
    for i, node in enumerate(handle["nodes"]):
        assert (Path(node["home"]) / "who").read_text() == f"{i}\n", node["home"]
    assert b.terminate(handle["name"]).removed


def _attrs(path: Path) -> str:
    out = subprocess.run(["lsattr", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return out.split()[0]


def test_clusters_are_spread_over_the_disk_on_ext4(tmp_path: Path) -> None:
    """Each local cluster's tree goes to block groups of its own (the clusters' directory is a "top of
    hierarchy", ``chattr +T``): on ext4 without a journal, files created next to the ones the previous
    cluster's teardown just deleted each scanned past all of them (a third of a 1,024-rank gang
    start's CPU). On a filesystem without the flag the backend works as before."""
    ext4 = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout
    if ext4.strip() != "ext2/ext3":
        pytest.fail(f"this test needs tmp_path on ext4 (stat -f says {ext4.strip()!r})")
    b = LocalBackend(tmp_path / "sky")
    b.provision("spread", task_from_args(num_nodes=2, run="true"))
    assert "T" in _attrs(b.base)
    b.terminate("spread")
    shm = Path("/dev/shm") / f"sky-topdir-{os.getpid()}"
    try:
        other = LocalBackend(shm)
        other.provision("spread", task_from_args(num_nodes=2, run="true"))
        other.terminate("spread")
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_a_torn_down_clusters_files_go_after_its_processes(sky_home: Path) -> None:
    """The teardown kills every process, then takes the cluster's tree off its path at once and deletes
    it in the background (1,024 nodes: ~20,000 files, most of the teardown's time). A tree a stopped
    machine left half-deleted goes with the next teardown."""
    import time

    from leaks import job_processes

    from airflow_provider_sky.watch.jobs import GangClient

    b = LocalBackend(sky_home)
    trash = sky_home / "local" / ".trash"
    trash.mkdir(parents=True)
    (trash / "left-by-a-crash" / "node-0").mkdir(parents=True)
    (trash / "left-by-a-crash" / "node-0" / "log").write_text("x")
    spec = task_from_args(num_nodes=8, run="echo hi; sleep 600")
    h = b.provision("c", spec)
    GangClient(b, h).launch(spec, "job", orphan_timeout=0)
    assert b.terminate("c", grace=0.5).removed
    assert not (sky_home / "local" / "c").exists() and b.find("c") is None
    assert not [p for p in job_processes(sky_home) if "sleep" in p[1]]
    deadline = time.time() + 10
    while any(trash.iterdir()) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(trash.iterdir()), list(trash.iterdir())
    # the name is free again at once
    again = b.provision("c", task_from_args(num_nodes=2, run="true"))
    assert len(again.nodes) == 2
    b.terminate("c")


def test_a_cluster_named_like_an_internal_directory_leaves_every_other_cluster_alone(sky_home: Path) -> None:
    """Cluster names and the backend's own paths never meet: a cluster named ``clusters`` (or ``trash``,
    ``lock``) once had the records' directory as its own, and its teardown erased every other cluster's
    record; the other cluster's ranks ran on and its own teardown found nothing (``removed=False``)."""
    from leaks import job_processes

    from airflow_provider_sky.watch.jobs import GangClient

    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=2, run="sleep 600")
    h = b.provision("train", spec)
    train = GangClient(b, h)
    train.launch(spec, "job", orphan_timeout=0)
    for name in ("clusters", "trash", "lock", "local"):
        other = b.provision(name, task_from_args(num_nodes=1, run="true"))
        assert not set(other.ips) & set(h.ips)
        assert b.terminate(name, grace=0.5).removed, name
        assert b.find("train") is not None, f"tearing down {name!r} took the record of 'train'"
        assert [r.state for r in train.peek("job").ranks] == ["running", "running"]
    assert b.terminate("train", grace=0.5).removed
    assert b.find("train") is None and not [p for p in job_processes(sky_home) if "sleep" in p[1]]


def test_a_record_that_names_another_cluster_is_never_acted_on(sky_home: Path) -> None:
    """A teardown acts only on a record whose full name is the one asked for: a record of ``b`` found
    where ``a``'s belongs (copied by hand, restored from a backup) is refused, and ``b`` runs on."""
    from airflow_provider_sky.watch.jobs import GangClient

    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=1, run="sleep 600")
    hb = b.provision("b", spec)
    GangClient(b, hb).launch(spec, "job", orphan_timeout=0)
    b.provision("a", task_from_args(num_nodes=1, run="true"))
    a_path, b_path = b.records_dir / "a.json", b.records_dir / "b.json"
    a_text = a_path.read_text()
    a_path.write_text(b_path.read_text())
    with pytest.raises(BackendError, match=r"names cluster 'b', not 'a'.*nothing"):
        b.terminate("a", grace=0.5)
    assert [r.state for r in GangClient(b, hb).peek("job").ranks] == ["running"]
    a_path.write_text(a_text)
    assert b.terminate("a").removed and b.terminate("b", grace=0.5).removed
