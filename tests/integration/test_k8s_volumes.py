"""SkyPilot's ``volumes`` on the kubernetes backend (the real cluster of tests/support/k8s_cluster.py): the
PersistentVolumeClaim of each name is mounted at its path in every pod."""

from __future__ import annotations

import secrets
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gangs import wait_done
from k8s_cluster import Image, K8sCluster, connection_extras

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.spec import task_from_args


@pytest.fixture
def claim(k8s: K8sCluster) -> Iterator[tuple[str, Path]]:
    """(a bound PersistentVolumeClaim, the directory behind it): a hostPath volume, which is the same
    directory on every node of the local cluster (its kubelets all run on this machine)."""
    name = f"sky-vol-{secrets.token_hex(4)}"
    data = Path("/tmp") / name
    data.mkdir(mode=0o777)
    data.chmod(0o777)
    (data / "hello.txt").write_text("from the volume\n")
    api = k8s.api()
    api.create_persistent_volume(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": name},
            "spec": {
                "capacity": {"storage": "1Mi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": str(data), "type": "Directory"},
                "claimRef": {"namespace": k8s.namespace, "name": name},
            },
        }
    )
    api.create_namespaced_persistent_volume_claim(
        k8s.namespace,
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": name},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": name,
                "resources": {"requests": {"storage": "1Mi"}},
            },
        },
    )
    try:
        deadline = time.time() + 30
        while api.read_namespaced_persistent_volume_claim(name, k8s.namespace).status.phase != "Bound":
            assert time.time() < deadline, "the claim was not bound"
            time.sleep(0.2)
        yield name, data
    finally:
        api.delete_namespaced_persistent_volume_claim(name, k8s.namespace)
        api.delete_persistent_volume(name)
        shutil.rmtree(data, ignore_errors=True)


def test_a_volume_is_mounted_in_every_pod(k8s: K8sCluster, k8s_image: Image, claim: tuple[str, Path]) -> None:
    name, data = claim
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    spec = task_from_args(
        num_nodes=2,
        run='cat /mnt/data/hello.txt && echo "rank $SKYPILOT_NODE_RANK" > /mnt/data/rank-$SKYPILOT_NODE_RANK',
        volumes={"/mnt/data": name},
    )
    from airflow_provider_sky.watch.jobs import GangClient

    h = b.provision("vol", spec)
    try:
        c = GangClient(b, h)
        c.launch(spec, "job")
        poll = wait_done(c, "job", timeout=60)
        assert [r.state for r in poll.status.ranks] == ["succeeded", "succeeded"], poll.status
        for rank in (0, 1):  # each pod wrote through its mount into the one directory
            assert (data / f"rank-{rank}").read_text() == f"rank {rank}\n"
    finally:
        b.terminate("vol")
        b.close()


def test_a_volume_that_is_not_there_is_named(k8s: K8sCluster, k8s_image: Image) -> None:
    b = by_kind("kubernetes").make({**connection_extras(k8s, k8s_image), "provision_timeout": 20})
    spec = task_from_args(run="true", volumes={"/mnt/data": "no-such-claim"})
    try:
        with pytest.raises(BackendError, match='persistentvolumeclaim "no-such-claim" not found'):
            b.provision("novol", spec)
    finally:
        b.terminate("novol")
        b.close()
