"""The Kubernetes backend touches only pods it made for the cluster at hand (real cluster).

A pod is ours when it has the cluster's label, the cluster's full name in the ``sky.airflow/cluster-name``
annotation and our role label. A pod that merely has the name ours would get, a user's pod with our label,
and another cluster whose name maps to the same pods are never deleted: a clash is an error naming the
pod, a teardown leaves them (with a warning). A teardown that cannot update the record on a running head
deletes nothing (another run's lease may be in it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_cluster import Image, K8sCluster, busybox_pod, connection_extras, wait_for
from kubernetes.client.rest import ApiException

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.headrecord import record_path
from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.kubernetes.manifest import CLUSTER_LABEL, ROLE_LABEL, dns_name, head_name
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.spec import task_from_args

ONE = task_from_args(num_nodes=1, run="true")
TWO = task_from_args(num_nodes=2, run="true")


@pytest.fixture(scope="module")
def backend(k8s: K8sCluster, k8s_image: Image) -> Iterator[KubernetesBackend]:
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    assert isinstance(b, KubernetesBackend)
    b.busy_wait = 15.0  # a provision that would wait on a foreign pod gives up soon
    yield b
    b.close()


def _foreign(
    b: KubernetesBackend,
    image: Image,
    name: str,
    labels: dict[str, str] | None = None,
    command: list[str] | None = None,
) -> str:
    """A pod someone else made (no annotation of ours); its uid."""
    pod = busybox_pod(name, image, command=command, labels=labels)
    return str(b.core.create_namespaced_pod(b.namespace, pod).metadata.uid)


def _untouched(b: KubernetesBackend, name: str, uid: str) -> bool:
    """The very pod ``uid`` is still there and nobody asked it to go."""
    pod = b.core.read_namespaced_pod(name, b.namespace)
    return bool(pod.metadata.uid == uid and pod.metadata.deletion_timestamp is None)


def _labelled(b: KubernetesBackend, label: str) -> dict[str, Any]:
    pods = b.core.list_namespaced_pod(b.namespace, label_selector=f"{CLUSTER_LABEL}={label}").items
    return {p.metadata.name: p for p in pods}


def _phase(b: KubernetesBackend, name: str, phases: tuple[str, ...]) -> None:
    wait_for(
        lambda: b.core.read_namespaced_pod(name, b.namespace).status.phase in phases,
        60,
        f"pod {name} in {phases}",
    )


def _remove(b: KubernetesBackend, *names: str) -> None:
    for name in names:
        b.core.delete_namespaced_pod(name, b.namespace, grace_period_seconds=0)


def test_a_pod_with_our_name_is_an_error_naming_it_and_only_what_was_created_goes(
    backend: KubernetesBackend, k8s_image: Image
) -> None:
    """A plain pod ``advk01-worker1`` (no labels of ours): the provision of ``advk01`` fails naming it,
    deletes the head it made, and leaves that pod alone (it used to delete it and put its own there)."""
    uid = _foreign(backend, k8s_image, "advk01-worker1")
    try:
        with pytest.raises(BackendError) as err:
            backend.provision("advk01", TWO)
        assert f"pod {backend.namespace}/advk01-worker1 already exists" in str(err.value)
        assert "not a pod this provider made" in str(err.value)
        assert _untouched(backend, "advk01-worker1", uid)
        left = _labelled(backend, "advk01")  # the head it created is deleted
        assert all(p.metadata.deletion_timestamp is not None for p in left.values()), list(left)
    finally:
        _remove(backend, "advk01-worker1")


def test_two_long_names_cut_to_the_same_pod_name_never_hit_each_other(backend: KubernetesBackend) -> None:
    """A 60-character name's pods are ``<its first 45>-<hash>-head``; a cluster literally named that is
    refused, naming the pod and its cluster, and neither its provision nor its teardown touches it."""
    long = "advk01-" + "l" * 53
    other = head_name(long).removesuffix("-head")
    assert head_name(other) == head_name(long) and other != long
    backend.provision(long, ONE, holder="a")
    try:
        uid = backend.core.read_namespaced_pod(head_name(long), backend.namespace).metadata.uid
        with pytest.raises(BackendError, match=rf"already exists and it belongs to cluster '{long}'"):
            backend.provision(other, ONE, holder="b")
        assert backend.terminate(other, holder="b").removed is False
        assert _untouched(backend, head_name(long), uid)
        assert backend.find(long) is not None
    finally:
        assert backend.terminate(long, holder="a").removed


def test_a_look_alike_cluster_name_neither_joins_nor_tears_down_another_cluster(
    backend: KubernetesBackend,
) -> None:
    """``AdvK02`` maps to pods and label ``advk02-4051ff``, as does a cluster literally named so: that one
    finds no cluster, is refused at provision, and its teardown leaves AdvK02's pods (the full name in
    their annotation is not its own)."""
    look_alike = "advk02-4051ff"
    assert dns_name("AdvK02") == look_alike == dns_name(look_alike)
    backend.provision("AdvK02", ONE, holder="run-a")
    try:
        uid = backend.core.read_namespaced_pod(head_name("AdvK02"), backend.namespace).metadata.uid
        assert backend.find(look_alike) is None
        assert backend.terminate(look_alike, holder="run-b").removed is False
        with pytest.raises(
            BackendError, match=r"belongs to cluster 'AdvK02', whose name maps to the same pods"
        ):
            backend.provision(look_alike, ONE, holder="run-b")
        assert _untouched(backend, head_name("AdvK02"), uid)
        assert backend.find("AdvK02") is not None
    finally:
        assert backend.terminate("AdvK02", holder="run-a").removed


def test_a_teardown_that_cannot_update_the_record_keeps_the_cluster(backend: KubernetesBackend) -> None:
    """Runs A and B hold ``advk03``; the record on the head cannot be written. A's teardown deletes
    nothing and says so (it used to log "could not be read" and delete B's cluster); B's lease stays.
    A forced teardown still removes it. The pods carry no service-account token."""
    h = backend.provision("advk03", ONE, holder="A")
    backend.provision("advk03", ONE, holder="B")
    try:
        head = backend.runner(h.nodes[0])
        # the swap script writes <record>.tmp first: a directory there makes every write fail, reads work
        broken = head.run_script(f'mkdir "$HOME/{record_path("advk03")}.tmp"')
        assert broken.returncode == 0, broken.error_text
        uid = backend.core.read_namespaced_pod("advk03-head", backend.namespace).metadata.uid
        with pytest.raises(
            BackendError, match=r"cluster 'advk03' kept, nothing deleted: .*could not be updated"
        ):
            backend.terminate("advk03", holder="A")
        assert _untouched(backend, "advk03-head", uid)
        record = backend.records("advk03").load("advk03")
        assert record is not None and set(record["leases"]) == {"A", "B"}
        token = head.run_script("test -e /var/run/secrets/kubernetes.io/serviceaccount/token")
        assert token.returncode == 1  # no API token in the pods for the job's code to read
    finally:
        assert backend.terminate("advk03", holder=None).removed  # forced: goes whatever the record says
    assert _labelled(backend, "advk03") == {}


def test_pods_with_our_label_that_are_not_ours_are_never_deleted(
    backend: KubernetesBackend, k8s_image: Image, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's debug pods labelled ``sky.airflow/cluster=advk05`` (one running, one failed) and a pod in
    place of a lost worker with our labels but not our annotation: replacing the worker, the teardown and
    provisions that find them (the join path, the clean-up of leftover failed pods) leave them all."""
    label = {CLUSTER_LABEL: "advk05"}
    foreign = ["advk05-debug", "advk05-crashed", "advk05-worker1"]
    h = backend.provision("advk05", TWO)
    try:
        uids = {
            "advk05-debug": _foreign(backend, k8s_image, "advk05-debug", label),
            "advk05-crashed": _foreign(backend, k8s_image, "advk05-crashed", label, ["sh", "-c", "exit 1"]),
        }
        # the worker is lost; a pod of someone else's takes its name (our labels, no annotation)
        _remove(backend, "advk05-worker1")
        wait_for(lambda: "advk05-worker1" not in _labelled(backend, "advk05"), 60, "advk05-worker1 gone")
        uids["advk05-worker1"] = _foreign(
            backend, k8s_image, "advk05-worker1", {**label, ROLE_LABEL: "worker"}, ["sh", "-c", "exit 1"]
        )
        replaced = backend.replace_nodes(h, [1])
        assert replaced.nodes[1].extra["pod"] == "advk05-worker2"
        _phase(backend, "advk05-debug", ("Running",))
        _phase(backend, "advk05-crashed", ("Failed",))
        _phase(backend, "advk05-worker1", ("Failed",))
        with caplog.at_level(logging.WARNING):
            assert backend.terminate("advk05").removed
        assert all(_untouched(backend, name, uid) for name, uid in uids.items())
        warned = " ".join(r.getMessage() for r in caplog.records)
        for name in foreign:
            assert f"{backend.namespace}/{name} carries the label {CLUSTER_LABEL}=advk05" in warned, warned
        assert set(_labelled(backend, "advk05")) == set(foreign)  # ours are gone
        # a provision beside a running foreign pod makes the cluster (it used to wait for it, then fail)
        backend.provision("advk05", ONE)
        assert backend.terminate("advk05").removed
        # beside only failed ones: the clean-up of leftover failed pods of the cluster leaves them
        _remove(backend, "advk05-debug")
        wait_for(lambda: "advk05-debug" not in _labelled(backend, "advk05"), 60, "advk05-debug gone")
        backend.provision("advk05", ONE)
        assert backend.terminate("advk05").removed
        assert all(_untouched(backend, n, uids[n]) for n in ("advk05-crashed", "advk05-worker1"))
    finally:
        backend.terminate("advk05", holder=None)
        for name in foreign:
            try:
                _remove(backend, name)
            except ApiException as exc:
                if exc.status != 404:
                    raise
