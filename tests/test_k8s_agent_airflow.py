"""Fail-fast holds with Airflow paused (issue 30), under a real Airflow on the real Kubernetes cluster.

A 4-rank gang runs in pods with python3 (their node agents decide the gang's fate on the head pod).
Every process of the Airflow stack is stopped (SIGSTOP: the api-server, the scheduler and its task
processes, the dag-processor, the triggerer with its shared poll, the launch-side bridge), as a
stalled or restarting control plane; then rank 3 exits 1. Its siblings in the other pods are gone
within seconds, with nothing on the Airflow side running; once Airflow resumes, the run fails, each
rank's task saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_sky.backends.kubernetes import agents
from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.dev.stack import AirflowStack
from airflow_provider_sky.operators._spec import default_cluster_name
from k8s_cluster import Image, K8sCluster, connection_extras

REPO = Path(__file__).resolve().parent.parent
DAG_ID = "sky_agt_paused"
#: the siblings must be gone this soon after rank 3's exit, Airflow stopped: the head's decision is a
#: scan and a message; the rest is the pods' own cancel on this shared 2-core machine, where each poll
#: of a pod below is an exec (the tight figure is in benchmarks/fig_k8s.py)
GONE_MARGIN = 5.0

pytestmark = [pytest.mark.airflow_services]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, k8s: K8sCluster, k8s_python_image: Image
) -> Iterator[tuple[AirflowStack, Path, dict[str, Any]]]:
    base = tmp_path_factory.mktemp("agt-airflow")
    dags = base / "dags"
    dags.mkdir()
    (dags / f"{DAG_ID}.py").symlink_to(REPO / "tests" / "dags" / f"{DAG_ID}.py")
    sky = base / "sky"
    sky.mkdir()
    extras = connection_extras(k8s, k8s_python_image)
    env = {
        "SKY_PROVIDER_HOME": str(sky),
        "AIRFLOW_CONN_SKY_AGT": json.dumps({"conn_type": "sky_kubernetes", "extra": extras}),
    }
    with AirflowStack(base / "airflow", dags, env) as airflow:
        yield airflow, sky, extras


def _stack_processes(sky: Path) -> list[int]:
    """Every process of the stack: services, task processes, bridges (all carry its SKY_PROVIDER_HOME)."""
    want = f"SKY_PROVIDER_HOME={sky}".encode()
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                if want in (entry / "environ").read_bytes().split(b"\0"):
                    out.append(int(entry.name))
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _sleeping(b: KubernetesBackend, pod: str) -> int:
    res = b._pod_runner(pod, pod).run_script("ps -o args | grep -c '^sleep 600' || true", timeout=30)
    return int(res.text.strip() or 0)


def test_a_failure_stops_the_siblings_with_airflow_paused_and_the_run_fails_once_resumed(
    stack: tuple[AirflowStack, Path, dict[str, Any]],
) -> None:
    airflow, sky, extras = stack
    b = by_kind("kubernetes").make(extras)
    assert isinstance(b, KubernetesBackend)
    run_id = airflow.trigger(DAG_ID)
    cluster = default_cluster_name(DAG_ID, run_id)
    try:

        def attached() -> bool:
            tis = {(t["task_id"], t["map_index"]): t["state"] for t in airflow.task_instances(DAG_ID, run_id)}
            ranks = [s for (tid, _), s in tis.items() if tid == "g.rank"]
            return len(ranks) == 4 and all(s == "deferred" for s in ranks)

        deadline = time.monotonic() + 240
        while not attached():
            assert time.monotonic() < deadline, airflow.task_instances(DAG_ID, run_id)
            assert airflow.dag_run(DAG_ID, run_id)["state"] in ("queued", "running")
            time.sleep(1)
        handle = airflow.xcom(DAG_ID, run_id, "g.cluster")
        assert agents.EXTRA_KEY in handle["extra"], airflow.task_log(DAG_ID, run_id, "g.cluster")  # agents
        pods = [n["extra"]["pod"] for n in handle["nodes"]]
        assert all(_sleeping(b, p) == 1 for p in pods[:3])

        paused = _stack_processes(sky)
        assert len(paused) >= 4, paused
        _signal(paused, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            b._pod_runner(pods[3], pods[3]).run_script("touch /tmp/agt-fail", timeout=30)
            gone_at = None
            while time.monotonic() - t0 < 60:
                if all(_sleeping(b, p) == 0 for p in pods[:3]):
                    gone_at = time.monotonic() - t0
                    break
            assert gone_at is not None, "the siblings still ran 60 s after rank 3 failed, Airflow paused"
            # from the pods' own records (one clock: every pod is on this machine): rank 3's exit ->
            # the last sibling's end
            ends = []
            for i, pod in enumerate(pods):
                script = (
                    f'for d in "$HOME"/.sky_airflow/*/jobs/*/{i}; do '
                    'cat "$d/end" 2>/dev/null || sed -n 2p "$d/exit"; done'
                )
                ends.append(float(b._pod_runner(pod, pod).run_script(script, timeout=30).text.split()[0]))
            latency = max(ends[:3]) - ends[3]
            print(
                f"\nrank 3 exit -> last sibling gone, Airflow paused: {latency:.2f}s (seen by exec: {gone_at:.1f}s)"
            )
            assert latency < GONE_MARGIN, ends
            assert airflow.procs and all(
                Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
                for p in paused
                if Path(f"/proc/{p}").exists()
            ), "an Airflow process ran meanwhile"
        finally:
            _signal(paused, signal.SIGCONT)

        assert airflow.wait_run(DAG_ID, run_id, timeout=180) == "failed"
        states = {
            t["map_index"]: t["state"]
            for t in airflow.task_instances(DAG_ID, run_id)
            if t["task_id"] == "g.rank"
        }
        assert states == dict.fromkeys(range(4), "failed"), states
        ip3 = handle["nodes"][3]["ip"]
        assert f"rank 3 ({ip3}) exited with code 1" in airflow.task_log(DAG_ID, run_id, "g.rank", 3)
        log0 = airflow.task_log(DAG_ID, run_id, "g.rank", 0)
        assert "cancelled" in log0 and "rank 3" in log0, log0
    finally:
        b.terminate(cluster)
        b.close()
