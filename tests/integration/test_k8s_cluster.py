"""Smoke tests of the Kubernetes test cluster itself, through the ``k8s`` fixture (tests/support/k8s_cluster.py):
scheduling with soft anti-affinity, exec with a script on stdin and its exit code, spreading over two
nodes, and a fake GPU advertised on a node (the scheduler's ``Insufficient nvidia.com/gpu``)."""

from __future__ import annotations

import secrets
import time
from collections import Counter
from collections.abc import Iterator

import pytest
from k8s_cluster import (
    ExecError,
    Image,
    K8sCluster,
    busybox_pod,
    describe_pod,
    exec_script,
    exit_status,
    wait_for,
    wait_running,
)

GPU = "nvidia.com/gpu"


def _name(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(3)}"


@pytest.fixture(scope="module")
def sleeper(k8s: K8sCluster, k8s_image: Image) -> Iterator[str]:
    """One running pod (soft anti-affinity, like the backend's rank pods) for the exec tests."""
    name, app = _name("sleeper"), _name("app")
    api = k8s.api()
    try:
        api.create_namespaced_pod(
            k8s.namespace, busybox_pod(name, k8s_image, labels={"app": app}, anti_affinity=app)
        )
        yield name
    finally:
        api.delete_namespaced_pod(name, k8s.namespace, grace_period_seconds=0)
        api.api_client.close()


def test_pod_with_soft_anti_affinity_runs(k8s: K8sCluster, sleeper: str) -> None:
    api = k8s.api()
    pod = wait_running(api, k8s.namespace, sleeper)
    assert pod.spec.node_name in k8s.nodes
    term = pod.spec.affinity.pod_anti_affinity.preferred_during_scheduling_ignored_during_execution[0]
    assert (term.weight, term.pod_affinity_term.topology_key) == (100, "kubernetes.io/hostname")
    assert pod.spec.containers[0].image_pull_policy in ("Never", "IfNotPresent")


def test_exec_script_on_stdin_with_length_prefix(k8s: K8sCluster, sleeper: str) -> None:
    wait_running(k8s.api(), k8s.namespace, sleeper)
    script = 'echo "rank $1 of $2"; echo "to stderr" >&2; printf "%s\\n" "$3"; exit 7\n'
    t0 = time.monotonic()
    result = exec_script(k8s, sleeper, script, args=("0", "4", "it's $HOME; quoted"))
    assert result.stdout == "rank 0 of 4\nit's $HOME; quoted\n"
    assert result.stderr == "to stderr\n"
    assert result.returncode == 7
    assert time.monotonic() - t0 < 10  # ends at once: head -c gives sh -s its EOF
    assert exec_script(k8s, sleeper, "true\n").returncode == 0
    big = "".join(f"echo line{i}\n" for i in range(2000))  # 25 kB of script: several websocket frames
    assert exec_script(k8s, sleeper, big).stdout.splitlines()[-1] == "line1999"


def test_exec_without_exit_status_is_never_success(k8s: K8sCluster, sleeper: str) -> None:
    # the status parser: no status, an empty or unreadable one, or a failure without an exit code -> None
    assert exit_status("") is None
    assert exit_status("not: [yaml") is None
    assert exit_status('{"status": "Failure", "message": "container not found"}') is None
    assert exit_status('{"status": "Success"}') == 0
    failure = '{"status": "Failure", "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}}'
    assert exit_status(failure) == 3
    wait_running(k8s.api(), k8s.namespace, sleeper)
    # still running when the deadline comes: an error, not a success
    with pytest.raises(ExecError, match="still running"):
        exec_script(k8s, sleeper, "sleep 30\n", timeout=2)
    # a real status without an exit code (the executable does not exist): None, not 0
    status = _exec_status(k8s, sleeper, ["/no/such/binary"])
    assert "Failure" in status and exit_status(status) is None, status
    # plain `sh -s`: before 1.30 (websocket protocol v4) stdin never reaches EOF (tests/k8s/NOTES.md)
    if k8s.server_version < (1, 30):
        with pytest.raises(ExecError, match="still running"):
            exec_script(k8s, sleeper, "echo hi\n", timeout=3, length_prefix=False)
    else:
        assert exec_script(k8s, sleeper, "echo hi\n", timeout=10, length_prefix=False).stdout == "hi\n"


def _exec_status(k8s: K8sCluster, pod: str, command: list[str]) -> str:
    """The raw error-channel status of an exec of ``command`` (no stdin)."""
    from kubernetes.stream import stream
    from kubernetes.stream.ws_client import ERROR_CHANNEL

    api = k8s.api()
    try:
        ws = stream(
            api.connect_get_namespaced_pod_exec,
            pod,
            k8s.namespace,
            command=command,
            stdout=True,
            stderr=True,
            stdin=False,
            tty=False,
            _preload_content=False,
        )
        status = ""
        deadline = time.monotonic() + 10
        while ws.is_open() and time.monotonic() < deadline:
            ws.update(timeout=1)
            status += ws.read_channel(ERROR_CHANNEL)
        status += ws.read_channel(ERROR_CHANNEL)
        ws.close()
    finally:
        api.api_client.close()
    return status


def test_four_pods_spread_two_and_two(k8s: K8sCluster, k8s_image: Image, k8s_pods: list[str]) -> None:
    assert len(k8s.nodes) >= 2, f"needs two schedulable nodes, has {k8s.nodes}"
    two = k8s.nodes[:2]
    app = _name("spread")
    api = k8s.api()
    for i in range(4):  # one at a time: each is scheduled knowing where the earlier ones went
        name = f"{app}-{i}"
        k8s_pods.append(name)
        pod = busybox_pod(
            name,
            k8s_image,
            labels={"app": app},
            anti_affinity=app,
            node_names=[k8s.hostnames[n] for n in two],
        )
        api.create_namespaced_pod(k8s.namespace, pod)
        wait_for(
            lambda n=name: api.read_namespaced_pod(n, k8s.namespace).spec.node_name, 60, f"{name} scheduled"
        )
    placed = Counter(wait_running(api, k8s.namespace, name).spec.node_name for name in k8s_pods)
    assert sorted(placed.values()) == [2, 2], placed
    assert set(placed) == set(two)


@pytest.fixture
def gpu_node(k8s: K8sCluster) -> Iterator[str]:
    """A node advertising 2 fake GPUs (what a device plugin would do), removed afterwards."""
    api = k8s.api()
    nodes = {n.metadata.name: n for n in api.list_node().items if n.metadata.name in k8s.nodes}
    # the last node first: tests/integration/test_k8s_backend.py fakes its GPUs on the first one (127.0.0.2)
    free = [n for n in reversed(k8s.nodes) if GPU not in (nodes[n].status.capacity or {})]
    name = free[0] if free else None
    assert name, f"every node already has {GPU}: cannot fake one"
    # capacity is what a device plugin reports; allocatable too, else the scheduler waits for the kubelet's
    # next status update (about 10 s) to see it
    paths = [f"/status/{field}/" + GPU.replace("/", "~1") for field in ("capacity", "allocatable")]
    api.patch_node_status(name, [{"op": "add", "path": p, "value": "2"} for p in paths])
    try:
        wait_for(
            lambda: api.read_node(name).status.allocatable.get(GPU) == "2", 30, f"{GPU} allocatable on {name}"
        )
        yield name
    finally:
        status = api.read_node(name).status
        have = [
            p
            for p, got in zip(paths, (status.capacity, status.allocatable), strict=True)
            if GPU in (got or {})
        ]
        if have:
            api.patch_node_status(name, [{"op": "remove", "path": p} for p in have])
        api.api_client.close()


def test_fake_gpu_schedules_and_oversubscription_stays_pending(
    k8s: K8sCluster, k8s_image: Image, k8s_pods: list[str], gpu_node: str
) -> None:
    api = k8s.api()
    total = sum(int(n.status.allocatable.get(GPU, "0")) for n in api.list_node().items)
    app = _name("gpu")
    fits, too_big = f"{app}-1", f"{app}-many"
    k8s_pods += [fits, too_big]
    api.create_namespaced_pod(k8s.namespace, busybox_pod(fits, k8s_image, labels={"app": app}, gpus=1))
    api.create_namespaced_pod(
        k8s.namespace, busybox_pod(too_big, k8s_image, labels={"app": app}, gpus=total + 1)
    )
    pod = wait_running(api, k8s.namespace, fits)
    assert pod.spec.node_name == gpu_node
    assert pod.spec.containers[0].resources.limits == {GPU: "1"}

    def unschedulable() -> str:
        pod = api.read_namespaced_pod(too_big, k8s.namespace)
        for c in pod.status.conditions or []:
            if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                return c.message or ""
        return ""

    message = wait_for(unschedulable, 30, f"{too_big} Unschedulable")
    assert f"Insufficient {GPU}" in message, message

    def failed_scheduling() -> list[str]:
        events = api.list_namespaced_event(k8s.namespace, field_selector=f"involvedObject.name={too_big}")
        return [e.message for e in events.items if e.reason == "FailedScheduling"]

    events = wait_for(failed_scheduling, 30, f"FailedScheduling event of {too_big}")
    assert any(f"Insufficient {GPU}" in m for m in events), events
    time.sleep(3)  # still Pending a moment later, not scheduled after all
    pod = api.read_namespaced_pod(too_big, k8s.namespace)
    assert (pod.status.phase, pod.spec.node_name) == ("Pending", None), describe_pod(
        api, k8s.namespace, too_big
    )
