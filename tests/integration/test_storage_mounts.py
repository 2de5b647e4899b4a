"""S3 buckets in file_mounts against moto's S3 server: COPY by presigned URLs on every node, MOUNT with rclone
(FUSE), and SkyPilot's storage forms loaded as SkyPilot means them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
from aws_fixtures import moto  # noqa: F401 (fixture)
from gangs import local_gang, wait_done
from moto_ec2 import REGION, MotoEC2
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.storage import S3Access
from airflow_provider_sky.hooks.aws import s3_access
from airflow_provider_sky.spec import SpecError, load_task_yaml, task_from_args
from airflow_provider_sky.spec.storage import StorageMount
from airflow_provider_sky.watch.jobs import GangClient
from unit.test_storage_mounts import needs_fuse

#: distinctive credentials, so a leak of either is found by a plain search
KEY_ID, SECRET = "AKIASKYSTORAGETEST01", "s3cr3t-storage-test-value-0123456789"


def _access(moto: MotoEC2) -> S3Access:
    """What the hook builds from an aws connection pointing at moto (a real Connection object)."""
    from airflow.models.connection import Connection

    conn = Connection(
        conn_id="aws_default",
        conn_type="aws",
        login=KEY_ID,
        password=SECRET,
        extra={"region_name": REGION, "endpoint_url": moto.url},
    )
    access: S3Access = s3_access(conn)
    return access


def _s3(moto: MotoEC2) -> Any:
    return boto3.client(
        "s3",
        region_name=REGION,
        endpoint_url=moto.url,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
    )


def _files_holding(root: Path, needle: bytes) -> list[Path]:
    found = []
    for p in root.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink() and needle in p.read_bytes():
                found.append(p)
        except OSError:
            continue
    return found


def test_s3_copy_reaches_every_node_with_no_credential_left(sky_home: Path, moto: MotoEC2) -> None:
    s3 = _s3(moto)
    s3.create_bucket(Bucket="copy-bkt")
    s3.put_object(Bucket="copy-bkt", Key="ds/a.txt", Body=b"alpha")
    s3.put_object(Bucket="copy-bkt", Key="ds/sub/b.bin", Body=os.urandom(300_000))
    s3.put_object(Bucket="copy-bkt", Key="other/c.txt", Body=b"not copied")
    mounts = {"~/data": "s3://copy-bkt/ds", "~/one.txt": "s3://copy-bkt/ds/a.txt"}
    b, client, spec = local_gang(
        sky_home, 2, "cat ~/data/a.txt ~/one.txt; wc -c < ~/data/sub/b.bin", file_mounts=mounts
    )
    b.sync_files(client.handle, spec, _access(moto))
    for node in client.handle.nodes:
        home = Path(node.home)
        assert (home / "data" / "a.txt").read_bytes() == b"alpha"
        assert (home / "data" / "sub" / "b.bin").stat().st_size == 300_000
        assert (home / "one.txt").read_bytes() == b"alpha"
        assert not (home / "data" / "c.txt").exists() and not (home / "other").exists()
        assert not list(home.rglob("*.sky-part"))
    # the run sees them; nothing on the nodes holds the secret or a signed URL
    client.launch(spec, "job")
    assert wait_done(client).status.succeeded
    assert not _files_holding(sky_home, SECRET.encode())
    assert not _files_holding(sky_home, b"X-Amz-Signature")


def test_s3_copy_of_a_missing_path_names_the_field(sky_home: Path, moto: MotoEC2) -> None:
    _s3(moto).create_bucket(Bucket="empty-bkt")
    b, client, spec = local_gang(sky_home, 1, "true", file_mounts={"~/d": "s3://empty-bkt/nothing"})
    with pytest.raises(SpecError, match=r"file_mounts\.~/d: s3://empty-bkt/nothing holds no object"):
        b.sync_files(client.handle, spec, _access(moto))


def _mounted(path: str) -> bool:
    return any(line.split()[1] == path for line in Path("/proc/mounts").read_text().splitlines())


@needs_fuse
def test_named_bucket_mount_is_created_written_through_and_unmounted_at_teardown(
    sky_home: Path, moto: MotoEC2, tmp_path: Path
) -> None:
    s3 = _s3(moto)
    yaml_file = tmp_path / "task.yaml"
    yaml_file.write_text(
        "num_nodes: 2\n"
        "envs:\n  OUT_BUCKET: sky-out-bkt\n"
        "file_mounts:\n  ~/outputs:\n    name: ${OUT_BUCKET}\n    mode: MOUNT\n"
        'run: echo "rank $SKYPILOT_NODE_RANK" > ~/outputs/rank-$SKYPILOT_NODE_RANK.txt; ls ~/outputs\n'
    )
    spec = load_task_yaml(yaml_file)
    assert spec.storage == {"~/outputs": StorageMount(url="s3://sky-out-bkt", mode="MOUNT")}
    from airflow_provider_sky.backends.local import LocalBackend

    b = LocalBackend(sky_home)
    client = GangClient(b, b.provision("m", spec))
    b.sync_files(client.handle, spec, _access(moto))
    s3.head_bucket(Bucket="sky-out-bkt")  # created, as SkyPilot creates a named bucket that is not there
    targets = [f"{n.home}/outputs" for n in client.handle.nodes]
    assert all(_mounted(t) for t in targets)
    b.sync_files(client.handle, spec, _access(moto))  # a cluster reused: mounted once, not twice
    assert sum(_mounted(t) for t in targets) == 2
    client.launch(spec, "job")
    assert wait_done(client).status.succeeded
    deadline = time.monotonic() + 20  # rclone uploads a written file when it is closed (writes cache)
    keys: set[str] = set()
    while time.monotonic() < deadline:
        keys = {o["Key"] for o in s3.list_objects_v2(Bucket="sky-out-bkt").get("Contents", [])}
        if keys >= {"rank-0.txt", "rank-1.txt"}:
            break
        time.sleep(0.2)
    assert keys >= {"rank-0.txt", "rank-1.txt"}
    # the rclone processes hold the credentials in their environment only: no file has them
    assert not _files_holding(sky_home, SECRET.encode())
    b.terminate("m")
    assert not any(_mounted(t) for t in targets)
    # the teardown unmounted before it deleted: the bucket keeps what the gang wrote
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket="sky-out-bkt").get("Contents", [])}
    assert keys >= {"rank-0.txt", "rank-1.txt"}


@needs_fuse
def test_mount_cached_of_an_s3_prefix_reads_the_objects(sky_home: Path, moto: MotoEC2) -> None:
    s3 = _s3(moto)
    s3.create_bucket(Bucket="cached-bkt")
    s3.put_object(Bucket="cached-bkt", Key="models/w.txt", Body=b"weights")
    storage = {"~/models": {"source": "s3://cached-bkt/models", "mode": "MOUNT_CACHED"}}
    b, client, spec = local_gang(sky_home, 1, "cat ~/models/w.txt", file_mounts=storage)
    assert spec.storage["~/models"].mode == "MOUNT_CACHED"
    b.sync_files(client.handle, spec, _access(moto))
    assert (Path(client.handle.nodes[0].home) / "models" / "w.txt").read_bytes() == b"weights"
    b.terminate("c")
    assert not _mounted(f"{client.handle.nodes[0].home}/models")


def test_the_hook_reaches_the_bucket_through_the_aws_default_connection(
    sky_home: Path, moto: MotoEC2, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the cluster task does: SkyHook.sync_files with the S3 credentials of the ``aws_default``
    connection (an AIRFLOW_CONN_ variable, as a deployment sets it), none of them on the node."""
    import json

    from airflow_provider_sky.hooks.sky import SkyHook

    s3 = _s3(moto)
    s3.create_bucket(Bucket="hook-bkt")
    s3.put_object(Bucket="hook-bkt", Key="cfg/app.yaml", Body=b"k: v\n")
    conn = {
        "conn_type": "aws",
        "login": KEY_ID,
        "password": SECRET,
        "extra": {"region_name": REGION, "endpoint_url": moto.url},
    }
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))
    hook = SkyHook()
    spec = task_from_args(run="cat ~/cfg/app.yaml", file_mounts={"~/cfg": "s3://hook-bkt/cfg"})
    hook.check(spec)
    handle = hook.provision("h", spec)
    hook.sync_files(handle, spec)
    assert (Path(handle.nodes[0].home) / "cfg" / "app.yaml").read_bytes() == b"k: v\n"
    assert not _files_holding(sky_home, SECRET.encode())
    hook.teardown("h", force=True)


@needs_sshd
def test_s3_copy_onto_ssh_hosts(moto: MotoEC2, tmp_path: Path) -> None:
    """The same COPY through real sshd hosts (SFTP-less: the script on the SSH channel's stdin)."""
    from airflow_provider_sky.backends.ssh import SSHBackend
    from airflow_provider_sky.runners import ssh

    s3 = _s3(moto)
    s3.create_bucket(Bucket="ssh-bkt")
    s3.put_object(Bucket="ssh-bkt", Key="d/x.txt", Body=b"over ssh")
    with SSHDCluster(2, tmp_path) as c:
        b = SSHBackend(
            c.host_list(),
            user="",
            key_file=c.client_key_path,
            known_hosts=c.known_hosts_path,
            connect_timeout=5.0,
            ready_timeout=5.0,
        )
        spec = task_from_args(num_nodes=2, run="cat ~/d/x.txt", file_mounts={"~/d": "s3://ssh-bkt/d"})
        handle = b.provision("s", spec)
        try:
            b.sync_files(handle, spec, _access(moto))
            for node in handle.nodes:
                res = b.runner(node).run_script("cat ~/d/x.txt")
                assert res.returncode == 0 and res.stdout == b"over ssh", res
        finally:
            b.terminate("s")
            ssh.close_all()


def test_a_bucket_name_left_null_is_given_at_launch_or_fails_before_provisioning(
    sky_home: Path,
    moto: MotoEC2,
    airflow_db: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """SkyPilot's examples leave ``name:`` for their user (tests/dags/sky_test_bucket_name.yaml). Under
    ``dag.test()``: never given, the cluster task fails naming the field and the ways to give it, and no
    cluster is made; given as ``file_mounts={"~/data": {"name": "{{ params.bucket }}"}}`` (a DAG param),
    every node gets the bucket's files."""
    import json

    from integration.test_dag_test import _load

    dags = _load("sky_test_bucket_name", folder="tests/dags")
    s3 = _s3(moto)
    s3.create_bucket(Bucket=dags.BUCKET)
    s3.put_object(Bucket=dags.BUCKET, Key="hello.txt", Body=b"hello from the bucket")
    conn = {
        "conn_type": "aws",
        "login": KEY_ID,
        "password": SECRET,
        "extra": {"region_name": REGION, "endpoint_url": moto.url},
    }
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(conn))

    dr = dags.missing.test()
    out, err = capfd.readouterr()
    text = out + err
    assert str(dr.state) == "failed"
    tis = {ti.task_id: ti for ti in dr.get_task_instances()}
    assert tis["g.cluster"].state == "failed"
    assert "file_mounts.~/data.name: no value given" in text, text[-3000:]
    assert "file_mounts={'~/data': {'name': 'my-bucket'}}" in text
    assert "Provisioning cluster" not in text
    assert not list((sky_home / "local").glob("sky-*")), "a cluster was made"

    dr = dags.given.test()
    out, err = capfd.readouterr()
    text = out + err
    assert str(dr.state) == "success", text[-3000:]
    for rank in (0, 1):
        assert f"hello from the bucket (rank {rank})" in text
    assert not list((sky_home / "local").glob("sky-*"))  # torn down at the end of the run
