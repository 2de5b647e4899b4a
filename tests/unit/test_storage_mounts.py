"""S3 buckets in file_mounts against moto's S3 server: COPY by presigned URLs on every node, MOUNT with rclone
(FUSE), and SkyPilot's storage forms loaded as SkyPilot means them."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from aws_fixtures import moto  # noqa: F401 (fixture)
from gangs import local_gang

from airflow_provider_sky.spec import SpecError, check_backend, fill_at_launch, load_task_yaml
from airflow_provider_sky.spec.capabilities import BackendCapabilities
from airflow_provider_sky.spec.storage import StorageMount

#: distinctive credentials, so a leak of either is found by a plain search
KEY_ID, SECRET = "AKIASKYSTORAGETEST01", "s3cr3t-storage-test-value-0123456789"


def test_bucket_without_aws_access_is_a_clear_error(sky_home: Path) -> None:
    b, client, spec = local_gang(sky_home, 1, "true", file_mounts={"~/d": "s3://some-bkt/x"})
    with pytest.raises(SpecError, match=r"file_mounts\.~/d: .*aws connection \(storage_aws_conn_id"):
        b.sync_files(client.handle, spec, None)


def _fuse_ok() -> bool:
    return (
        bool(shutil.which("rclone"))
        and bool(shutil.which("fusermount3") or shutil.which("fusermount"))
        and (os.access("/dev/fuse", os.R_OK | os.W_OK))
    )


needs_fuse = pytest.mark.skipif(
    not _fuse_ok(),
    reason="rclone, fusermount3 and a usable /dev/fuse are needed (make system-deps: rclone fuse3)",
)


def test_skypilot_storage_forms_load_as_skypilot_means_them(tmp_path: Path) -> None:
    (tmp_path / "code").mkdir()
    f = tmp_path / "t.yaml"
    f.write_text(
        "workdir: .\n"
        "envs:\n  DATA: sky-data\n  CKPT: null\n"
        "file_mounts:\n"
        "  /copy: {name: $DATA, mode: COPY}\n"
        "  /src: {source: s3://sky-data/train, mode: COPY}\n"
        "  /local: {name: up-bkt, source: ./code, mode: COPY}\n"
        "  /mnt: {source: s3://sky-data/train}\n"
        "  /up: {name: up-bkt, source: ./code, mode: MOUNT_CACHED, persistent: false}\n"
        "  /ckpt: {name: '${CKPT}', mode: MOUNT}\n"
        "  rel/file.py: ./code\n"
        "run: ls\n"
    )
    spec = load_task_yaml(f)
    assert spec.file_mounts == {
        "/copy": "s3://sky-data",
        "/src": "s3://sky-data/train",
        "/local": str(tmp_path / "code"),
        "~/sky_workdir/rel/file.py": str(tmp_path / "code"),
    }
    assert spec.storage == {
        "/mnt": StorageMount(url="s3://sky-data/train", mode="MOUNT"),
        "/up": StorageMount(
            url="s3://up-bkt", mode="MOUNT_CACHED", upload=str(tmp_path / "code"), persistent=False
        ),
    }
    # a bucket named by an env given at launch: parsed once the value is there
    assert spec.unset == ("envs.CKPT",) and "/ckpt" in spec.mounts_at_launch
    filled, _ = fill_at_launch(spec, params={"CKPT": "ckpt-bkt"})
    assert filled.storage["/ckpt"] == StorageMount(url="s3://ckpt-bkt", mode="MOUNT")
    assert not filled.mounts_at_launch


@pytest.mark.parametrize(
    ("mount", "field", "fragment"),
    [
        ({"/d": "gs://b/x"}, "file_mounts./d", "Google Cloud Storage; this provider fetches and mounts S3"),
        ({"/d": {"name": "b1", "store": "gcs"}}, "file_mounts./d.store", "is 'gcs'"),
        ({"/d": {"source": "oci://b@r", "mode": "MOUNT"}}, "file_mounts./d.source", "OCI Object Storage"),
        ({"/d": {"mode": "MOUNT"}}, "file_mounts./d", "needs a bucket: give name:"),
        ({"/d": {"name": "YOUR_BUCKET"}}, "file_mounts./d.name", "is not an S3 bucket name"),
        (
            {"/d": {"name": "bkt", "mode": "SYNC"}},
            "file_mounts./d.mode",
            "must be one of COPY, MOUNT, MOUNT_CACHED",
        ),
        ({"/d": {"name": "$NOPE"}}, "file_mounts./d.name", "uses $NOPE, which envs does not give"),
        ({"/d": {"source": ["./a", "./b"], "name": "bkt"}}, "file_mounts./d.source", "lists 2 sources"),
        # a bucket name left null is given at launch; the rest of its mount is checked when it is loaded
        ({"/d": {"name": None, "store": "gcs"}}, "file_mounts./d.store", "is 'gcs'"),
        ({"/d": {"name": None, "mode": "SYNC"}}, "file_mounts./d.mode", "must be one of COPY, MOUNT"),
    ],
)
def test_storage_that_cannot_be_honoured_is_refused_by_name(
    mount: dict[str, Any], field: str, fragment: str
) -> None:
    from airflow_provider_sky.spec import task_from_args

    with pytest.raises(SpecError) as info:
        task_from_args(run="true", file_mounts=mount)
    assert info.value.field == field
    assert fragment in info.value.message


def test_kubernetes_refuses_a_bucket_mount_before_provisioning_but_copies() -> None:
    from airflow_provider_sky.spec import task_from_args

    caps = BackendCapabilities(
        name="kubernetes",
        max_nodes=10,
        supported_resources=frozenset(),
        clouds=frozenset({"kubernetes"}),
        supports_fuse_mounts=False,
        no_fuse_why="its pods are not privileged",
    )
    check_backend(task_from_args(run="true", file_mounts={"/d": "s3://bkt/x"}), caps)
    with pytest.raises(
        SpecError, match=r"file_mounts\./d: the kubernetes backend cannot mount bucket s3://bkt"
    ):
        check_backend(task_from_args(run="true", file_mounts={"/d": {"name": "bkt", "mode": "MOUNT"}}), caps)


#: SkyPilot's examples leave the bucket name for their user to write (examples/docker/echo_app.yaml)
NULL_NAME_YAML = """\
file_mounts:
  /inputs: ./in
  /outputs:
    name: # Set unique bucket name here!
    mode: MOUNT
  ~/ckpt:
    name:
    mode: COPY
  ~/code:
    name:  # a local source copied needs no bucket
    source: ./in
    mode: COPY
run: ls /outputs
"""


def _null_name_yaml(tmp_path: Path) -> Path:
    (tmp_path / "in").mkdir()
    path = tmp_path / "task.yaml"
    path.write_text(NULL_NAME_YAML)
    return path


def test_a_bucket_name_left_null_loads_and_is_given_at_launch(tmp_path: Path) -> None:
    path = _null_name_yaml(tmp_path)
    spec = load_task_yaml(path)
    assert spec.unset == ("file_mounts./outputs.name", "file_mounts.~/ckpt.name")
    assert spec.file_mounts == {"/inputs": str(tmp_path / "in"), "~/code": str(tmp_path / "in")}
    assert not spec.storage
    # nothing is provisioned while it is missing: the error names the field and the ways to give it
    with pytest.raises(SpecError) as info:
        fill_at_launch(spec)
    assert info.value.field == "file_mounts./outputs.name, file_mounts.~/ckpt.name"
    assert "file_mounts={'/outputs': {'name': 'my-bucket'}}" in info.value.message
    assert "{'name': '{{ params.bucket }}'}" in info.value.message
    # the file_mounts argument is merged into the YAML's mounts, destination by destination
    given = load_task_yaml(
        path, overrides={"file_mounts": {"/outputs": {"name": "out-bkt"}, "~/ckpt": {"name": "ck-bkt"}}}
    )
    assert not given.unset
    assert given.storage == {"/outputs": StorageMount(url="s3://out-bkt", mode="MOUNT")}
    assert given.file_mounts == {
        "/inputs": str(tmp_path / "in"),
        "~/ckpt": "s3://ck-bkt",
        "~/code": str(tmp_path / "in"),
    }
    # None removes a destination of the YAML's; a value that is not a mapping replaces it
    dropped = load_task_yaml(path, overrides={"file_mounts": {"/outputs": None, "~/ckpt": "s3://bkt-2/x"}})
    assert dropped.unset == () and dropped.file_mounts["~/ckpt"] == "s3://bkt-2/x"
    assert "/outputs" not in dropped.file_mounts and not dropped.storage


def test_a_null_bucket_name_round_trips_and_kubernetes_refuses_its_mount() -> None:
    from airflow_provider_sky.spec import parse_task, task_from_args

    spec = task_from_args(run="true", file_mounts={"/o": {"name": None, "mode": "MOUNT"}})
    assert parse_task(spec.to_dict()) == spec
    caps = BackendCapabilities(
        name="kubernetes",
        max_nodes=10,
        supported_resources=frozenset(),
        clouds=frozenset({"kubernetes"}),
        supports_fuse_mounts=False,
        no_fuse_why="its pods are not privileged",
    )
    with pytest.raises(
        SpecError, match=r"file_mounts\./o: the kubernetes backend cannot mount a bucket \(MOUNT\)"
    ):
        check_backend(spec, caps)
    check_backend(task_from_args(run="true", file_mounts={"/o": {"name": None, "mode": "COPY"}}), caps)


def test_a_templated_bucket_name_counts_as_given_at_launch_until_rendered() -> None:
    """``file_mounts={"/outputs": {"name": "{{ params.bucket }}"}}``: checked at parse time as a name left
    null, the rendered value at run time."""
    from airflow_provider_sky.operators._params import parse_time

    over = {"file_mounts": {"/o": {"name": "{{ params.bucket }}"}, "/s": "{{ params.src }}", "/k": "./k"}}
    assert parse_time(over) == {"file_mounts": {"/o": {"name": None}, "/k": "./k"}}
