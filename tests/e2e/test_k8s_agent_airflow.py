"""Fail-fast holds with Airflow paused, under a real Airflow: on the real Kubernetes cluster, on
4 real sshd hosts and on the local backend, one Airflow stack for all three.

A 4-rank gang runs; every process of the Airflow stack is stopped (SIGSTOP: the api-server, the
scheduler and its task processes, the dag-processor, the triggerer with its shared poll, the launch-side
bridge when there is one), as a stalled or restarting control plane; then rank 3 exits 1. Its siblings
are gone within seconds (SSH: within a second) with nothing on the Airflow side running; once Airflow
resumes, the run fails, each rank's task saying why. The same with only the triggerer killed (SIGKILL)
during the gang: a new one started after the failure picks the rank triggers up. On Kubernetes the pods have python3, so their node
agents decide on the head pod; on SSH each host (a loopback address of this machine, its own user and
home) runs an agent and the head host's decides; on the local backend every node is on one machine,
whose wrappers cancel their siblings themselves, or, with ``node_agent`` ("local agents"), each node's
agent reports to the head node's as on the other backends. ``SKY_TEST_AGENT_OFF=1`` runs the Kubernetes and SSH
cases on the per-node path (``node_agent: false``), where they must fail: the siblings on other nodes
run on until a watcher polls.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from k8s_cluster import Image, K8sCluster, connection_extras
from leaks import bridges
from sshd import SKIP_REASON, SSHDCluster, needs_sshd

from airflow_provider_sky.backends.kubernetes import agents
from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.nodeagents import EXTRA_KEY
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.operators._spec import default_cluster_name
from devstack.stack import AirflowStack, group_members

REPO = Path(__file__).resolve().parents[2]
DAG_FILE = "sky_agt_paused.py"
#: the siblings must be gone this soon after rank 3's exit, Airflow stopped: on Kubernetes the head's
#: decision is a scan and a message, the rest each pod's own cancel on this shared 2-core machine, and
#: each look at a pod below is an exec (the tight figure is benchmarks/fig_k8s.py's)
GONE_MARGIN = 5.0
#: the same on SSH, the issue's goal: every host, agent and rank is a process of this machine, so the
#: chain is rank 3's exit record -> its host's agent (a scan every 0.05 s) -> the head's agent -> one
#: message to each other host's agent -> a signal to its rank's group, a few Python wake-ups on loopback
#: and no exec (benchmarks/fig_failfast_agent.py: 0.05 s median at 8 hosts, 0.27 s at 64, when the
#: machine ran other suites too): 1 s leaves room for this machine's load, and a gang whose siblings
#: waited for Airflow (the per-node path: the paused triggerer's poll) would miss it by far
SSH_GONE_MARGIN = 1.0

pytestmark = [pytest.mark.airflow_services]


@dataclass
class Stack:
    airflow: AirflowStack
    sky: Path
    extras: dict[str, Any]
    base: Path
    #: a directory every host's user can look into (the test's own tree is root's, 0700): the SSH
    #: case's fail file, which the test (root) creates and rank 3 (its host's user) waits for
    shared: Path
    agent_off: bool


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, k8s: K8sCluster, k8s_python_image: Image
) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("agt-airflow")
    dags = base / "dags"
    dags.mkdir()
    (dags / DAG_FILE).symlink_to(REPO / "tests" / "dags" / DAG_FILE)
    sky = base / "sky"
    sky.mkdir()
    extras = connection_extras(k8s, k8s_python_image)
    agent_off = bool(os.environ.get("SKY_TEST_AGENT_OFF"))  # the same test on the per-node path: it must fail
    if agent_off:
        extras["node_agent"] = False
    env = {
        "SKY_PROVIDER_HOME": str(sky),
        "AIRFLOW_CONN_SKY_AGT": json.dumps({"conn_type": "sky_kubernetes", "extra": extras}),
        "AIRFLOW_CONN_SKY_AGT_LOCAL": json.dumps({"conn_type": "sky_local"}),
        "AIRFLOW_CONN_SKY_AGT_LOCAL_AGENTS": json.dumps(
            {"conn_type": "sky_local", "extra": {"node_agent": not agent_off}}
        ),
    }
    shared = Path(tempfile.mkdtemp(prefix="sky-agt-"))
    shared.chmod(0o755)
    try:
        # the hosts before the stack (its services read the connection from their environment), and
        # stopped after it (the run's teardown ends the agents over SSH)
        with SSHDCluster(4, base) if not SKIP_REASON else contextlib.nullcontext() as hosts:
            if hosts is not None:
                ssh_extra = {"node_agent": False} if agent_off else {}
                env["AIRFLOW_CONN_SKY_AGT_SSH"] = hosts.sky_ssh_connection(**ssh_extra)
            with AirflowStack(base / "airflow", dags, env) as airflow:
                yield Stack(airflow, sky, extras, base, shared, agent_off)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _stack_processes(stack: Stack) -> list[int]:
    """Every process of the Airflow stack: each service's process group, every ``airflow ...`` process
    with its SKY_PROVIDER_HOME (task processes, wherever their session), and the bridges; not the ranks
    (the local backend's wrappers and keeper run on this machine and stay up, as a node would)."""
    want = f"SKY_PROVIDER_HOME={stack.sky}".encode()
    out = {pid for proc in stack.airflow.procs.values() for pid in group_members(proc.pid)}
    out.update(pid for pid, _ in bridges(stack.sky))
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            with contextlib.suppress(OSError):
                cmd = (entry / "cmdline").read_bytes()
                if cmd.startswith(b"airflow") and want in (entry / "environ").read_bytes().split(b"\0"):
                    out.add(int(entry.name))
    return sorted(out)


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _local_sleeps(job_id: str) -> int:
    """The job's ``sleep 600`` processes on this machine (the local backend's ranks)."""
    want = f"SKYPILOT_TASK_ID={job_id}".encode()
    n = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "cmdline").read_bytes() == b"sleep\x00600\x00" and want in (
                    entry / "environ"
                ).read_bytes().split(b"\0"):
                    n += 1
    return n


def _record(end: Callable[[int], float], rank: int) -> float:
    """A rank's end time once its record is written: the wrapper takes the time when the command ended
    and writes it after the rank's log is complete (up to 2 s later), so its process can be gone first."""
    deadline = time.monotonic() + 15
    while True:
        try:
            return end(rank)
        except (OSError, IndexError, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def _rank_log(airflow: AirflowStack, dag_id: str, run_id: str, rank: int) -> str:
    """A rank task's log with the lines Airflow's triggerer filed in its own log instead (its known race
    when many triggers end in one burst, as every rank's does once the paused triggerer resumes)."""
    text = airflow.task_log(dag_id, run_id, "g.rank", rank)
    return "\n".join([text, *airflow.filed_trigger_lines(dag_id, run_id, "g.rank", rank, text)])


@pytest.mark.parametrize("where", ["kubernetes", "local", pytest.param("ssh", marks=needs_sshd)])
def test_a_failure_stops_the_siblings_with_airflow_paused_and_the_run_fails_once_resumed(
    stack: Stack, where: str
) -> None:
    _fails_with_airflow_away(stack, where, "paused")


@pytest.mark.parametrize("where", ["kubernetes", "local agents", pytest.param("ssh", marks=needs_sshd)])
def test_a_failure_stops_the_siblings_with_the_triggerer_killed_and_the_run_fails_once_it_is_back(
    stack: Stack, where: str
) -> None:
    """The triggerer (with its shared poll and every rank's trigger) is killed (SIGKILL) while the gang
    runs, then rank 3 fails: the head's agent stops the siblings; a new triggerer picks the rank
    triggers up and the run fails, each rank's task saying why."""
    _fails_with_airflow_away(stack, where, "triggerer killed")


def _fails_with_airflow_away(stack: Stack, where: str, how: str) -> None:
    airflow = stack.airflow
    dag_id = {
        "kubernetes": "sky_agt_paused",
        "local": "sky_agt_paused_local",
        "local agents": "sky_agt_paused_local_agents",
        "ssh": "sky_agt_paused_ssh",
    }[where]
    # one per case: a file left by the one before fails at once
    name = f"agt-fail-{how.replace(' ', '-')}-{where.replace(' ', '-')}"
    fail_file = f"/tmp/{name}" if where == "kubernetes" else str(stack.shared / name)
    margin = SSH_GONE_MARGIN if where == "ssh" else GONE_MARGIN
    # what the look below adds to it: an exec per pod on Kubernetes; on this machine rank 3's own look
    # at the fail file (every 0.2 s) and a /proc scan
    look = 0.5 if where == "ssh" else 1.0
    b = by_kind("kubernetes").make(stack.extras)
    assert isinstance(b, KubernetesBackend)
    run_id = airflow.trigger(dag_id, {"fail_file": fail_file})
    cluster = default_cluster_name(dag_id, run_id)
    try:

        def attached() -> bool:
            tis = {(t["task_id"], t["map_index"]): t["state"] for t in airflow.task_instances(dag_id, run_id)}
            ranks = [s for (tid, _), s in tis.items() if tid == "g.rank"]
            return len(ranks) == 4 and all(s == "deferred" for s in ranks)

        deadline = time.monotonic() + 240
        while not attached():
            assert time.monotonic() < deadline, airflow.task_instances(dag_id, run_id)
            assert airflow.dag_run(dag_id, run_id)["state"] in ("queued", "running")
            time.sleep(1)
        handle = airflow.xcom(dag_id, run_id, "g.cluster")
        job_id = str(airflow.xcom(dag_id, run_id, "g.job")[0]["job_id"])
        sleeping: Callable[[], int]
        if where != "local":  # the agent path, unless SKY_TEST_AGENT_OFF turned it off
            assert agents.EXTRA_KEY == EXTRA_KEY
            if stack.agent_off:
                assert EXTRA_KEY not in handle["extra"]
            else:
                assert EXTRA_KEY in handle["extra"], airflow.task_log(dag_id, run_id, "g.cluster")
                # the head took the gang: the job task started no launch-side watcher (bridge)
                assert not bridges(stack.sky), bridges(stack.sky)
                assert "node agents watch the gang" in airflow.task_log(dag_id, run_id, "g.job")
        if where == "kubernetes":
            pods = [n["extra"]["pod"] for n in handle["nodes"]]

            def sleeping() -> int:
                script = "ps -o args | grep -c '^sleep 600' || true"
                return sum(
                    int(b._pod_runner(p, p).run_script(script, timeout=30).text.strip() or 0)
                    for p in pods[:3]
                )

            def fail() -> None:
                b._pod_runner(pods[3], pods[3]).run_script(f"touch {fail_file}", timeout=30)

            def end(rank: int) -> float:
                pod = pods[rank]
                d = f"{handle['nodes'][rank]['root']}/jobs/{job_id}/{rank}"
                script = f'cat "{d}/end" 2>/dev/null || sed -n 2p "{d}/exit"'
                return float(b._pod_runner(pod, pod).run_script(script, timeout=30).text.split()[0])
        else:  # local and SSH: every node's processes run on this machine (SSH: as its host's user)

            def sleeping() -> int:
                return _local_sleeps(job_id)

            def fail() -> None:
                Path(fail_file).touch()

            def end(rank: int) -> float:
                # SSH: a node's root is in its host user's home, on this machine
                d = Path(handle["nodes"][rank]["root"], "jobs", job_id, str(rank))
                text = (
                    (d / "end").read_text()
                    if (d / "end").exists()
                    else (d / "exit").read_text().split("\n")[1]
                )
                return float(text.split()[0])

        assert sleeping() == 3

        paused: list[int] = []
        if how == "paused":
            paused = _stack_processes(stack)
            assert len(paused) >= 4, paused
            _signal(paused, signal.SIGSTOP)
            # every watcher is stopped: a bridge that runs (the per-node path) is among them
            assert {pid for pid, _ in bridges(stack.sky)} <= set(paused), (bridges(stack.sky), paused)
        else:
            airflow.kill_service("triggerer")
            assert not bridges(stack.sky) or stack.agent_off, bridges(stack.sky)
        try:
            t0 = time.monotonic()
            fail()
            gone_at = None
            while time.monotonic() - t0 < 60:
                if sleeping() == 0:
                    gone_at = time.monotonic() - t0
                    break
                time.sleep(0.05)
            assert gone_at is not None, "the siblings still ran 60 s after rank 3 failed, Airflow paused"
            # the ranks' own records (one clock: every node is on this machine); whole seconds in the
            # busybox image (its date has no %N), so the look above bounds it too
            ends = [_record(end, r) for r in range(4)]
            latency = max(ends[:3]) - ends[3]
            print(
                f"\n{where}: rank 3 exit -> last sibling gone, {how}: {latency:.2f}s (records), seen {gone_at:.2f}s after the fail file"
            )
            assert latency < margin and gone_at < margin + look, (ends, gone_at)
            stopped = [p for p in paused if Path(f"/proc/{p}").exists()]
            assert all(
                Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for p in stopped
            )
        finally:
            if how == "paused":
                _signal(paused, signal.SIGCONT)
            else:
                airflow.start_service("triggerer")

        assert airflow.wait_run(dag_id, run_id, timeout=180) == "failed"
        states = {
            t["map_index"]: t["state"]
            for t in airflow.task_instances(dag_id, run_id)
            if t["task_id"] == "g.rank"
        }
        assert states == dict.fromkeys(range(4), "failed"), states
        ip3 = handle["nodes"][3]["ip"]
        assert f"rank 3 ({ip3}) exited with code 1" in _rank_log(airflow, dag_id, run_id, 3)
        log0 = _rank_log(airflow, dag_id, run_id, 0)
        assert "cancelled" in log0 and "rank 3" in log0, log0
    finally:
        if where == "kubernetes":
            b.terminate(cluster)
        b.close()
