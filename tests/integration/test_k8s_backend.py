"""The Kubernetes backend on a real cluster (tests/support/k8s_cluster.py: the local two-node one, or yours):
pods, spreading, exec, fail-fast, pod loss, GPUs as the scheduler sees them, teardown, examples under
``dag.test()``. Every example DAG and the seed YAMLs run on the cluster under a real scheduler and triggerer in
``tests/e2e/test_airflow_real.py`` (``real[kubernetes]``); here, under ``dag.test()``, the examples whose
checks need the ranks' own log lines (retries, the hang's stack dump, ``@task.sky``)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_cluster import Image, K8sCluster, cluster_cpus, connection_extras, wait_for

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.kubernetes.manifest import CLUSTER_LABEL, NAME_ANNOTATION, ROLE_LABEL
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.loop import watch

GPU_NODE = "127.0.0.2"  # k8s-local.sh's second node


@pytest.fixture(scope="module")
def extras(k8s: K8sCluster, k8s_image: Image) -> dict[str, Any]:
    """A ``sky_kubernetes`` connection's extras for the test cluster."""
    return connection_extras(k8s, k8s_image)


@pytest.fixture
def backend(extras: dict[str, Any]) -> Iterator[KubernetesBackend]:
    b = by_kind("kubernetes").make(extras)
    assert isinstance(b, KubernetesBackend)
    yield b
    b.close()


def _pods(b: KubernetesBackend, cluster: str | None = None) -> list[Any]:
    selector = f"{CLUSTER_LABEL}={cluster}" if cluster else CLUSTER_LABEL
    return list(b.core.list_namespaced_pod(b.namespace, label_selector=selector).items)


def _wait(client: GangClient, job_id: str, timeout: float = 90, **kw: Any) -> Any:
    async def go() -> Any:
        last = None
        async for poll in watch(client, job_id, poll_interval=0.2, **kw):
            last = poll
        return last

    return asyncio.run(asyncio.wait_for(go(), timeout))


def test_a_gang_is_one_pod_per_node_spread_over_the_machines(
    backend: KubernetesBackend, k8s: K8sCluster
) -> None:
    spec = task_from_args(
        num_nodes=4,
        run='echo "$SKYPILOT_NODE_RANK $SKYPILOT_NUM_NODES $MASTER_ADDR $(hostname)"',
        setup="test -d /dev/shm",
    )
    h = backend.provision("spread", spec, holder="t")
    assert h.nodes[0].node_id == "spread-head"
    ips = [n.ip for n in h.nodes[1:]]
    assert ips == sorted(ips, key=lambda ip: tuple(int(p) for p in ip.split(".")))  # workers by IP
    machines = [n.extra["k8s_node"] for n in h.nodes]
    if len(k8s.nodes) >= 2:  # soft anti-affinity: 2 + 2 on the two-node test cluster
        assert sorted(machines.count(m) for m in set(machines)) == [2, 2], machines
    c = GangClient(backend, h)
    c.launch(spec, "job")
    poll = _wait(c, "job")
    assert [r.state for r in poll.status.ranks] == ["succeeded"] * 4
    for rank, node in enumerate(h.nodes):
        out = c.poll("job").chunks[rank][1].decode().split()
        assert out == [str(rank), "4", h.nodes[0].ip, node.node_id]
    assert backend.find("spread") is not None
    assert backend.terminate("spread", holder="t").removed is True
    assert _pods(backend, "spread") == []
    assert backend.find("spread") is None
    assert backend.terminate("spread").removed is False  # idempotent


def test_fail_fast_kills_every_sibling(backend: KubernetesBackend) -> None:
    run = 'if [ "$SKYPILOT_NODE_RANK" == "2" ]; then sleep 1; exit 1; fi; sleep 10000'
    spec = task_from_args(num_nodes=4, run=run)
    h = backend.provision("ff", spec)
    c = GangClient(backend, h)
    c.launch(spec, "job")
    poll = _wait(c, "job")
    assert {r.rank: r.state for r in poll.status.ranks} == {
        0: "cancelled",
        1: "cancelled",
        2: "failed",
        3: "cancelled",
    }
    assert f"rank 2 ({h.nodes[2].ip}) exited with code 1" in poll.status.failure_message()
    for node in h.nodes:  # no sleep left in any pod
        ps = backend.runner(node).run_script("ps -o args | grep -c '^sleep 10000' || true").text.strip()
        assert ps == "0", (node.node_id, ps)
    backend.terminate("ff")
    assert _pods(backend, "ff") == []


def test_a_64_pod_gang_fails_fast_without_healthy_pods_called_lost(backend: KubernetesBackend) -> None:
    """At 64 pods one round of execs (one runc exec each on this 2-core machine) outlasts the poll's
    time limit when they are all made at once: healthy pods were reported "stopped answering", then
    lost, the cancel missed them and the watch never ended. Calls go 16 at a time, each timed from its
    own start, and a rank that outlives the cancel gets it again."""
    n = 64
    run = f'if [ "$SKYPILOT_NODE_RANK" = "{n - 1}" ]; then sleep 3; exit 1; fi; sleep 10000'
    spec = task_from_args(num_nodes=n, run=run)
    h = backend.provision("wide", spec)
    try:
        c = GangClient(backend, h)
        c.launch(spec, "job")
        seen_unreachable: set[int] = set()

        async def go() -> Any:
            last = None
            async for poll in watch(c, "job", poll_interval=0.5):
                seen_unreachable.update(poll.unreachable)
                last = poll
            return last

        poll = asyncio.run(asyncio.wait_for(go(), 150))
        states = {r.rank: r.state for r in poll.status.ranks}
        assert states.pop(n - 1) == "failed"
        assert set(states.values()) == {"cancelled"}, states
        assert not seen_unreachable, f"healthy pods reported not answering: {sorted(seen_unreachable)}"
        left = c.peek("job")
        assert all(r.terminal for r in left.ranks)
    finally:
        backend.terminate("wide")
    assert _pods(backend, "wide") == []


def test_a_deleted_pod_is_lost_and_the_gang_fails_fast(backend: KubernetesBackend) -> None:
    spec = task_from_args(num_nodes=3, run="sleep 10000")
    h = backend.provision("loss", spec)
    c = GangClient(backend, h)
    c.launch(spec, "job")
    time.sleep(2)
    victim = h.nodes[1].node_id
    backend.core.delete_namespaced_pod(victim, backend.namespace, grace_period_seconds=0)
    poll = _wait(c, "job", lost_after=3.0)
    states = {r.rank: r.state for r in poll.status.ranks}
    assert states[1] == "lost" and states[0] == "cancelled" and states[2] == "cancelled", states
    assert "lost" in poll.status.failure_message()
    backend.terminate("loss")
    assert _pods(backend, "loss") == []


def _ghost_pod(b: KubernetesBackend, cluster: str, pod: str, image: str) -> None:
    """A Running pod of ours (our labels and annotation) on a node no kubelet serves: nothing acts on it
    but the API server and us.

    It stands in for a kubelet that is slow to finish a deletion (CI: a deleted pod, phase Failed, kept
    62 s) or a node that cannot be reached.
    """
    b.core.create_namespaced_pod(
        b.namespace,
        {
            "metadata": {
                "name": pod,
                "labels": {CLUSTER_LABEL: cluster, ROLE_LABEL: "worker"},
                "annotations": {NAME_ANNOTATION: cluster},
            },
            "spec": {"nodeName": "ghost-node", "containers": [{"name": "node", "image": image}]},
        },
    )
    b.core.patch_namespaced_pod_status(
        pod, b.namespace, {"status": {"phase": "Running", "podIP": "10.9.9.9"}}
    )


def test_teardown_removes_a_stopped_pod_the_kubelet_is_slow_to_let_go(
    backend: KubernetesBackend, k8s_image: Image
) -> None:
    """Once the kubelet reports the containers stopped (phase Failed), the teardown does not wait for it."""
    _ghost_pod(backend, "slowgo", "slowgo-worker1", k8s_image.name)

    def kubelet_reports_stopped() -> None:  # what the kubelet does after killing the containers
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            pod = backend.core.read_namespaced_pod("slowgo-worker1", backend.namespace)
            if pod.metadata.deletion_timestamp is not None:
                backend.core.patch_namespaced_pod_status(
                    "slowgo-worker1", backend.namespace, {"status": {"phase": "Failed"}}
                )
                return
            time.sleep(0.1)

    reporter = threading.Thread(target=kubelet_reports_stopped)
    reporter.start()
    started = time.monotonic()
    try:
        result = backend.terminate("slowgo")
    finally:
        reporter.join()
    assert result.removed and result.unclean == (), result
    assert _pods(backend, "slowgo") == []
    assert time.monotonic() - started < 20  # not the 60 s wait for a kubelet that never finishes


def test_a_pod_still_running_after_the_wait_is_reported_not_forced(
    backend: KubernetesBackend, k8s_image: Image, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod nobody confirms stopped (an unreachable node) may still run the job: it is named, not hidden."""
    import airflow_provider_sky.backends.kubernetes.backend as kb

    monkeypatch.setattr(kb, "DELETE_WAIT", 3.0)
    _ghost_pod(backend, "unreach", "unreach-worker1", k8s_image.name)
    try:
        result = backend.terminate("unreach")
        assert result.unclean == ("unreach-worker1",), result
        assert [p.metadata.name for p in _pods(backend, "unreach")] == ["unreach-worker1"]
    finally:
        backend.core.delete_namespaced_pod("unreach-worker1", backend.namespace, grace_period_seconds=0)


def test_20_concurrent_commands_10_rounds_on_one_pod_all_succeed(backend: KubernetesBackend) -> None:
    """The seed document's concurrency check (20 at once, 10 rounds), through the exec API."""
    spec = task_from_args(num_nodes=1, run="true")
    h = backend.provision("conc", spec)
    runner = backend.runner(h.nodes[0])

    async def round_(i: int) -> list[Any]:
        return await asyncio.gather(
            *(
                runner.arun_script('echo "$1 $2"; exit $(($2 % 3))', [str(i), str(k)], timeout=60)
                for k in range(20)
            )
        )

    for i in range(10):
        results = asyncio.run(round_(i))
        assert [r.text for r in results] == [f"{i} {k}\n" for k in range(20)]
        assert [r.returncode for r in results] == [k % 3 for k in range(20)]
    backend.terminate("conc")


def test_workdir_and_file_mounts_are_copied_into_every_pod(
    backend: KubernetesBackend, tmp_path: Path
) -> None:
    wd = tmp_path / "wd"
    (wd / "sub").mkdir(parents=True)
    (wd / "train.sh").write_text('echo "trained $(cat sub/data) $1"\n')
    (wd / "train.sh").chmod(0o755)
    (wd / "sub" / "data").write_bytes(b"\xffbinary-ok")
    mount = tmp_path / "conf.txt"
    mount.write_text("conf\n")
    spec = task_from_args(
        num_nodes=2,
        run='./train.sh "$SKYPILOT_NODE_RANK" && pwd && cat ~/etc/conf.txt',
        workdir=str(wd),
        file_mounts={"~/etc/conf.txt": str(mount)},
    )
    h = backend.provision("wd", spec)
    backend.sync_files(h, spec)
    c = GangClient(backend, h)
    c.launch(spec, "job")
    assert [r.state for r in _wait(c, "job").status.ranks] == ["succeeded"] * 2
    out = c.poll("job").chunks[1][1]
    assert out == f"trained \xffbinary-ok 1\n{h.nodes[1].home}/sky_workdir\nconf\n".encode("latin-1")
    backend.terminate("wd")


def test_an_image_that_cannot_start_names_the_image_and_leaves_no_pod(extras: dict[str, Any]) -> None:
    b = KubernetesBackend.from_config(
        {**extras, "image": "sky-test/no-such-image:1", "image_pull_policy": "Never"}
    )
    t = time.monotonic()
    with pytest.raises(BackendError, match=r"ErrImageNeverPull for image 'sky-test/no-such-image:1'"):
        b.provision("noimg", task_from_args(num_nodes=2, run="true"))
    assert time.monotonic() - t < 60  # fails when the pod says so, not at the timeout
    assert _pods(b, "noimg") == []


@pytest.fixture
def fake_gpus(k8s: K8sCluster) -> Iterator[str]:
    """Two fake ``nvidia.com/gpu`` on one node, labelled as SkyPilot's labeler would (``v100``)."""
    api = k8s.api()
    node = GPU_NODE if GPU_NODE in k8s.nodes else k8s.nodes[-1]

    def allocatable() -> str | None:
        return (api.read_node_status(node).status.allocatable or {}).get("nvidia.com/gpu")

    api.patch_node_status(node, {"status": {"capacity": {"nvidia.com/gpu": "2"}}})
    api.patch_node(node, {"metadata": {"labels": {"skypilot.co/accelerator": "v100"}}})
    # the scheduler counts allocatable, which the kubelet derives from capacity at its next node status
    # update: under load that came after the pods were refused ("1 Insufficient nvidia.com/gpu")
    wait_for(lambda: allocatable() == "2", 60, f"2 nvidia.com/gpu allocatable on {node}")
    yield node
    api.patch_node_status(node, [{"op": "remove", "path": "/status/capacity/nvidia.com~1gpu"}])
    api.patch_node(node, {"metadata": {"labels": {"skypilot.co/accelerator": None}}})
    wait_for(lambda: allocatable() is None, 60, f"no nvidia.com/gpu allocatable on {node}")
    api.api_client.close()


def test_gpus_are_requested_whole_on_the_labelled_node(backend: KubernetesBackend, fake_gpus: str) -> None:
    spec = task_from_args(
        num_nodes=2, run='echo "$SKYPILOT_NUM_GPUS_PER_NODE"', resources={"accelerators": "V100:0.5"}
    )
    h = backend.provision("gpu", spec)
    assert {n.extra["k8s_node"] for n in h.nodes} == {fake_gpus}  # the node selector, 1 + 1 of 2 GPUs
    pods = _pods(backend, "gpu")
    assert {p.spec.containers[0].resources.limits["nvidia.com/gpu"] for p in pods} == {"1"}
    assert {p.metadata.annotations["sky.airflow/accelerators"] for p in pods} == {"V100:0.5"}
    c = GangClient(backend, h)
    c.launch(spec, "job")
    _wait(c, "job")
    assert c.poll("job").chunks[0][1] == b"1\n"
    backend.terminate("gpu")
    with pytest.raises(
        BackendError, match=r"cannot be scheduled: 0/\d+ nodes are available:.*Insufficient nvidia.com/gpu"
    ):
        backend.provision(
            "gpu4", task_from_args(num_nodes=2, run="true", resources={"accelerators": "V100:4"})
        )
    assert _pods(backend, "gpu4") == []


def test_the_test_button(extras: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow_provider_sky.hooks.sky import SkyKubernetesHook  # type: ignore[attr-defined]

    monkeypatch.setenv("AIRFLOW_CONN_SKY_K", json.dumps({"conn_type": "sky_kubernetes", "extra": extras}))
    ok, message = SkyKubernetesHook("sky_k").test_connection()
    assert ok and "pods and exec allowed" in message, message
    bad = {**extras, "kube_config_path": "/nonexistent/kubeconfig"}
    monkeypatch.setenv("AIRFLOW_CONN_SKY_K", json.dumps({"conn_type": "sky_kubernetes", "extra": bad}))
    ok, message = SkyKubernetesHook("sky_k").test_connection()
    assert not ok and "kube_config_path '/nonexistent/kubeconfig'" in message, message


@pytest.fixture
def held_cpus() -> Iterator[None]:
    """The test cluster's CPUs, held for a test whose examples ask for a CPU per pod (sky_taskflow):
    see ``cluster_cpus``."""
    with cluster_cpus():
        yield


def test_the_retry_hang_and_taskflow_examples_on_kubernetes(
    extras: dict[str, Any],
    held_cpus: None,
    airflow_db: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The examples with retries, hang detection and ``@task.sky``, unchanged, on pods under ``dag.test()``
    (the operators and the triggers in one process): a gang that fails once and succeeds on attempt 2 with
    no process of attempt 1 left in any pod; ranks that hang are found, their stacks dumped from the pod's
    /proc, the run failed naming them; the TaskFlow gang succeeds. The logs of a real triggerer may miss
    a burst's last lines on Kubernetes (see test_airflow_real's test_fail_fast): these lines are read here."""
    from integration.test_dag_test import _load, _out, _run

    monkeypatch.setenv(
        "AIRFLOW_CONN_SKY_DEFAULT", json.dumps({"conn_type": "sky_kubernetes", "extra": extras})
    )
    b = KubernetesBackend.from_config(extras)
    dr, tis = _run("sky_retry")
    out = _out(capfd)
    assert str(dr.state) == "success", out[-5000:]
    assert out.count("processes of attempt 1 still alive: 0") >= 4, out[-5000:]
    assert "==== attempt 2/3: rank 2 exited 1, retryable by retry_on_exit_codes ====" in out
    dr, tis = _run("sky_hang")
    out = _out(capfd)
    assert str(dr.state) == "failed" and tis[("down", -1)].state == "success"
    assert "hung: no output for 10 s (ranks 1, 3)" in out, out[-5000:]
    assert "==== end of the stack dump of rank 1 ====" in out, out[-5000:]
    dr = _load("sky_taskflow").dag.test()  # its first task, `steps`, is outside the gang's group
    out = _out(capfd)
    assert str(dr.state) == "success", out[-5000:]
    ranks = [ti for ti in dr.get_task_instances() if ti.task_id == "train.rank"]
    assert len(ranks) == 4 and {str(ti.state) for ti in ranks} == {"success"}
    assert _pods(b) == []  # every cluster was torn down


def test_a_gpu_no_node_has_is_refused_before_any_pod_exists(
    backend: KubernetesBackend, fake_gpus: str
) -> None:
    """``A1000:8`` once made pods that sat unschedulable until the provision failed; the nodes' labels
    say so before anything is created, with the names they carry and a guess at the typo."""
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.spec import SpecError

    spec = task_from_args(num_nodes=2, run="true", resources={"accelerators": "A1000:8"})
    t = time.monotonic()
    with pytest.raises(SpecError) as err:
        choose_resources(backend, spec, "typo")
    assert time.monotonic() - t < 10  # one list of the nodes, no pod waited for
    assert err.value.field == "resources.accelerators"
    assert "no node of the cluster has A1000 GPUs (nodes labelled skypilot.co/accelerator: v100)" in str(
        err.value
    )
    assert "did you mean A100" in str(err.value)
    assert _pods(backend, "typo") == []
    ok = task_from_args(num_nodes=2, run="true", resources={"accelerators": "V100:1"})
    assert choose_resources(backend, ok, "fine").resources.accelerators is not None
