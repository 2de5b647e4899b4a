"""What happens to pods over a gang's life (real cluster): a rank killed for memory is "out of memory", not a
bare 137 and not "cancelled" (the node runtime reads the container's memory cgroup OOM-kill count around
the rank); a cluster left idle for ``idle_down`` ends its pods, which give their resources back."""

from __future__ import annotations

import time

from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from integration.test_k8s_backend import _wait, backend, extras  # noqa: F401  (fixtures)

#: grows a shell string until the container's limit stops it
HOG = 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then x=0123456789; while :; do x="$x$x"; done; fi; sleep 10000'


def test_a_rank_over_its_memory_limit_is_out_of_memory_and_fails_the_gang(backend: KubernetesBackend) -> None:
    spec = task_from_args(num_nodes=2, run=HOG, resources={"memory": "0.0625"})  # 64 MiB, a limit (no '+')
    h = backend.provision("oom", spec)
    c = GangClient(backend, h)
    c.launch(spec, "job")
    poll = _wait(c, "job")
    by_rank = {r.rank: r for r in poll.status.ranks}
    assert by_rank[1].state == "failed" and by_rank[1].exit_code == 137, by_rank[1]
    assert "out of memory" in by_rank[1].reason, by_rank[1].reason
    # the sibling is cancelled, and says so (naming rank 1's cause): it is not out of memory itself
    assert by_rank[0].state == "cancelled", by_rank[0]
    assert by_rank[0].reason == "cancelled: rank 1 failed first: " + by_rank[1].reason, by_rank[0].reason
    assert "rank 1" in poll.status.failure_message() and "out of memory" in poll.status.failure_message()
    backend.terminate("oom")


def test_an_idle_cluster_ends_its_pods_and_teardown_removes_them(backend: KubernetesBackend) -> None:
    spec = task_from_args(num_nodes=2, run="true")
    h = backend.provision("idle", spec)
    c = GangClient(backend, h)
    c.launch(spec, "job", idle_down=2)
    assert [r.state for r in _wait(c, "job").status.ranks] == ["succeeded"] * 2
    deadline = time.monotonic() + 60
    phases: list[str] = []
    while time.monotonic() < deadline:
        pods = backend.core.list_namespaced_pod(
            backend.namespace, label_selector="sky.airflow/cluster=idle"
        ).items
        phases = sorted(p.status.phase for p in pods)
        if phases == ["Succeeded", "Succeeded"]:
            break
        time.sleep(1)
    assert phases == ["Succeeded", "Succeeded"]  # the entrypoints exited: no CPU, memory or GPU held
    assert backend.find("idle") is None
    assert backend.terminate("idle").removed
    assert (
        backend.core.list_namespaced_pod(backend.namespace, label_selector="sky.airflow/cluster=idle").items
        == []
    )
