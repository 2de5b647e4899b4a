"""The node agent on Kubernetes (a real cluster, tests/support/k8s_cluster.py): each pod's own process is the
agent when its image has python3; the gang's start, status and cancel are one call to the head's agent,
and a rank's failure stops its siblings on every pod with nothing on the Airflow side polling. Without
python3 (busybox), or with a head that does not answer, the per-node path does the same."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from k8s_cluster import Image, K8sCluster, connection_extras

from airflow_provider_sky.backends.kubernetes import agents
from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.kubernetes.manifest import CLUSTER_LABEL
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.loop import watch

N = 4
#: how long after the failing rank's exit every sibling on every pod must have ended: the head's
#: decision is one scan (0.05 s) and one message; the rest is each pod's own cancel on this shared
#: 2-core machine (the tight figure is benchmarks/fig_k8s.py's)
FAILFAST_MARGIN = 3.0


@pytest.fixture(scope="module")
def backend(k8s: K8sCluster, k8s_python_image: Image) -> Iterator[KubernetesBackend]:
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_python_image))
    assert isinstance(b, KubernetesBackend)
    yield b
    b.close()


@pytest.fixture(scope="module")
def cluster(backend: KubernetesBackend) -> Iterator[Any]:
    spec = task_from_args(num_nodes=N, run="true")
    h = backend.provision("agt", spec)
    try:
        yield h
    finally:
        backend.terminate("agt")


def _watch(client: GangClient, job_id: str, timeout: float = 90, **kw: Any) -> list[Any]:
    async def go() -> list[Any]:
        return [poll async for poll in watch(client, job_id, poll_interval=0.2, **kw)]

    return asyncio.run(asyncio.wait_for(go(), timeout))


def test_every_pod_runs_the_agent_as_its_own_process_and_the_token_stays_off_command_lines(
    backend: KubernetesBackend, cluster: Any
) -> None:
    where = agents.endpoint(cluster.extra)
    assert where is not None and where[0] == cluster.nodes[0].ip
    found = backend.agent_endpoint(cluster)
    assert found is not None
    token = found[2].decode()
    assert len(token) >= 32 and token not in json.dumps(cluster.to_dict())  # not in the handle (XCom)
    pods = backend.core.list_namespaced_pod(backend.namespace, label_selector="sky.airflow/cluster=agt").items
    assert token not in json.dumps(backend.core.api_client.sanitize_for_serialization(pods))  # nor the pods
    for node in cluster.nodes:
        res = backend.runner(node).run_script(
            'tr "\\0" " " < /proc/1/cmdline; echo; stat -c %a "$HOME/.sky_agent" "$HOME/.sky_agent/token"; '
            'for f in /proc/[0-9]*/cmdline; do tr "\\0" " " < "$f"; echo; done'
        )
        lines = res.text.splitlines()
        assert lines[0].startswith("python3 ") and "agent.py --node " + node.node_id in lines[0], lines[0]
        assert lines[1:3] == ["700", "600"], lines[1:3]
        assert not any(token in line for line in lines), "the token is on a command line"


def test_a_failure_stops_every_sibling_on_every_pod_with_nothing_polling(
    backend: KubernetesBackend, cluster: Any
) -> None:
    """Rank 3 exits 1 while nothing on this side polls: the head's agent cancels the others itself."""
    run = f'if [ "$SKYPILOT_NODE_RANK" = "{N - 1}" ]; then sleep 2; exit 1; fi; sleep 10000'
    spec = task_from_args(num_nodes=N, run=run)
    c = GangClient(backend, cluster)
    words = c.launch(spec, "ff")
    assert words == dict.fromkeys(range(N), "STARTED")
    assert (c.agent_calls, c.node_calls) == (1, 0)  # the start: one call to the head, no exec per pod
    time.sleep(2 + FAILFAST_MARGIN + 1)  # nothing polls meanwhile
    status = c.peek("ff")
    assert (c.agent_calls, c.node_calls) == (2, 0)  # a status: one call
    states = {r.rank: r.state for r in status.ranks}
    assert states == {0: "cancelled", 1: "cancelled", 2: "cancelled", N - 1: "failed"}, status.ranks
    failed = status.by_rank(N - 1)
    assert f"rank {N - 1} failed first" in status.by_rank(0).reason, status.by_rank(0).reason
    assert failed.end is not None
    last = max(r.end or 0 for r in status.ranks)
    assert last - failed.end < FAILFAST_MARGIN, {r.rank: r.end for r in status.ranks}
    for node in cluster.nodes:  # nothing left running in any pod
        ps = backend.runner(node).run_script("ps -o args | grep -c '^sleep 10000' || true").text.strip()
        assert ps == "0", (node.node_id, ps)


def test_a_watched_gang_costs_one_status_call_per_poll_and_its_logs_arrive(
    backend: KubernetesBackend, cluster: Any
) -> None:
    run = 'echo "hello from $SKYPILOT_NODE_RANK"; sleep 3; echo "bye $SKYPILOT_NODE_RANK"'
    spec = task_from_args(num_nodes=N, run=run)
    c = GangClient(backend, cluster)
    c.launch(spec, "ok")
    polls = _watch(c, "ok")
    assert [r.state for r in polls[-1].status.ranks] == ["succeeded"] * N
    assert c.agent_calls == 1 + len(polls)  # the start, then one call per poll at any N
    out: dict[int, bytes] = {}
    for poll in polls:
        for rank, (_, data) in poll.chunks.items():
            out[rank] = out.get(rank, b"") + data
    assert {r: out.get(r, b"").decode().split("\n")[:2] for r in range(N)} == {
        r: [f"hello from {r}", f"bye {r}"] for r in range(N)
    }
    # logs are read only when they grew: at most two reads per pod here (the two lines), never one per poll
    assert c.node_calls <= 3 * N < len(polls) * N, (c.node_calls, len(polls))


def test_a_cancel_from_airflow_is_one_call_and_waits_until_every_rank_ended(
    backend: KubernetesBackend, cluster: Any
) -> None:
    spec = task_from_args(num_nodes=N, run="sleep 10000")
    c = GangClient(backend, cluster)
    c.launch(spec, "cx")
    time.sleep(1)
    before = c.agent_calls
    c.cancel("cx", grace=1.0, reason="marked failed by a user")
    assert c.node_calls == 0
    status = c.peek("cx")
    assert {r.state for r in status.ranks} == {"cancelled"}
    assert all("marked failed by a user" in r.reason for r in status.ranks), status.ranks
    assert c.agent_calls - before >= 2  # the cancel, then status calls until every rank ended


def test_a_head_agent_that_does_not_answer_leaves_the_per_node_path(
    backend: KubernetesBackend, cluster: Any
) -> None:
    assert agents.endpoint(cluster.extra) is not None
    wrong = {"host": cluster.nodes[0].ip, "port": 1}  # nothing listens there
    h = dataclasses.replace(cluster, extra={**cluster.extra, agents.EXTRA_KEY: wrong})
    run = 'if [ "$SKYPILOT_NODE_RANK" = "1" ]; then sleep 1; exit 1; fi; sleep 10000'
    spec = task_from_args(num_nodes=N, run=run)
    c = GangClient(backend, h)
    c.launch(spec, "pn")
    polls = _watch(c, "pn")
    assert {r.rank: r.state for r in polls[-1].status.ranks} == {
        0: "cancelled",
        1: "failed",
        2: "cancelled",
        3: "cancelled",
    }
    assert c.node_calls >= N  # the per-node path


def test_an_image_without_python_keeps_the_per_node_path(k8s: K8sCluster, k8s_image: Image) -> None:
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    assert isinstance(b, KubernetesBackend)
    spec = task_from_args(num_nodes=2, run="true")
    try:
        h = b.provision("agt-bb", spec)
        assert agents.EXTRA_KEY not in h.extra  # busybox: no python3, no agent
        assert b.agent_endpoint(h) is None
        c = GangClient(b, h)
        c.launch(spec, "bb")
        assert [r.state for r in _watch(c, "bb")[-1].status.ranks] == ["succeeded"] * 2
        assert c.agent_calls == 0
    finally:
        b.terminate("agt-bb")
        b.close()


def test_node_agent_off_in_the_connection_keeps_the_per_node_path(
    k8s: K8sCluster, k8s_python_image: Image
) -> None:
    b = by_kind("kubernetes").make({**connection_extras(k8s, k8s_python_image), "node_agent": "false"})
    assert isinstance(b, KubernetesBackend)
    spec = task_from_args(num_nodes=2, run="true")
    try:
        h = b.provision("agt-off", spec)
        assert agents.EXTRA_KEY not in h.extra
        pid1 = b.runner(h.nodes[0]).run_script("tr '\\0' ' ' < /proc/1/cmdline").text
        assert pid1.startswith("/bin/sh -c trap"), pid1  # the idle entrypoint, no agent
    finally:
        b.terminate("agt-off")
        b.close()


def test_a_control_plane_that_does_not_reach_the_head_gives_up_on_agents_soon() -> None:
    """Pod IPs unreachable from where Airflow runs (outside the cluster): provisioning falls back to the
    per-node path after AGENT_REACH_WAIT, not after the whole join wait."""
    from airflow_provider_sky.backends.kubernetes import backend as kb
    from airflow_provider_sky.backends.kubernetes.config import KubeSettings

    b = KubernetesBackend(KubeSettings())
    t = time.monotonic()
    assert not b._agents_joined("c", "127.0.0.1", 1, b"0" * 48, ["c-head"])  # nothing listens on port 1
    took = time.monotonic() - t
    assert kb.AGENT_REACH_WAIT <= took < kb.AGENT_REACH_WAIT + 5 < kb.AGENT_JOIN_WAIT, took


def test_a_dag_on_agent_pods_starts_no_launch_side_watcher_and_still_fails_fast(
    k8s: K8sCluster,
    k8s_python_image: Image,
    airflow_db: Any,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """The seed scenario (the example ``sky_fail_fast``, unchanged) under ``dag.test()`` on pods with python3:
    the job task starts the gang with one call to the head and no launch-side watcher (the head decides
    the gang's fate); rank 2's failure still fails the run with every rank task failed and the cluster
    torn down."""
    from integration.test_dag_test import _out, _run, _states

    extras = connection_extras(k8s, k8s_python_image)
    monkeypatch.setenv(
        "AIRFLOW_CONN_SKY_DEFAULT", json.dumps({"conn_type": "sky_kubernetes", "extra": extras})
    )
    dr, tis = _run("sky_fail_fast")
    out = _out(capfd)
    assert str(dr.state) == "failed", out[-5000:]
    assert _states(tis, "rank") == {0: "failed", 1: "failed", 2: "failed", 3: "failed"}
    assert tis[("down", -1)].state == "success"
    assert "The cluster's node agents watch the gang" in out, out[-5000:]
    assert "launch-side watcher (pid" not in out, out[-5000:]
    assert "rank 2 failed first: exited with code 1" in out, out[-5000:]
    b = by_kind("kubernetes").make(extras)
    try:
        pods = b.core.list_namespaced_pod(b.namespace, label_selector=CLUSTER_LABEL).items
        # the DAG's cluster is gone (this module's own cluster, ``agt``, lives until the module ends)
        assert not [p.metadata.name for p in pods if p.metadata.name.startswith("sky-sky-fail-fast-")], pods
    finally:
        b.close()
