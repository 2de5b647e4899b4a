"""Every example DAG under a real Airflow: api-server, scheduler (LocalExecutor), dag-processor, triggerer.

One stack for the whole module (its startup is the expensive part). All five DAGs are triggered at
once when it is up, so they also run concurrently, each on its own local cluster; every test then
waits for its run and asserts what a user sees, read back from Airflow's REST API: run and task
states, task logs (worker and triggerer parts) and XComs.

The services use their own ``SKY_PROVIDER_HOME`` (not the per-test one of ``conftest.sky_home``), so
the leak checks here look there: after each run nothing may run under its cluster's directory and
the directory must be gone (the teardown ran); at the end nothing may run under the whole home.

The module runs twice (the ``real`` fixture is parametrized): once on the embedded local backend,
once with ``sky_default`` pointing at 4 real sshd hosts (``AIRFLOW_CONN_SKY_DEFAULT``, a ``sky_ssh``
connection over an :class:`SSHDCluster`, in every service's environment). The DAG files are the
same; on SSH the cleanup check looks at the hosts: no process of a host's user but SSH sessions,
and no cluster directory or record left in any host's home.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_provider_sky.dev.stack import AirflowStack, parse_time
from leaks import processes_under
from sshd import SSHDCluster, needs_sshd

REPO = Path(__file__).resolve().parent.parent
DAGS = ("sky_fail_fast", "sky_hello", "sky_segfault", "sky_failed_setup", "sky_yaml")
RUN_TIMEOUT = 180.0

pytestmark = pytest.mark.airflow_services


@dataclass
class RealAirflow:
    stack: AirflowStack
    sky: Path
    run_ids: dict[str, str]
    #: the SSH hosts ``sky_default`` points at, or None on the local backend
    hosts: SSHDCluster | None = None

    def finished(self, dag_id: str) -> tuple[str, str]:
        """(run id, final state) of the DAG's run."""
        run_id = self.run_ids[dag_id]
        return run_id, self.stack.wait_run(dag_id, run_id, timeout=RUN_TIMEOUT)

    def tis(self, dag_id: str, run_id: str) -> dict[tuple[str, int], dict[str, Any]]:
        return {(t["task_id"], t["map_index"]): t for t in self.stack.task_instances(dag_id, run_id)}

    def log(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
        return self.stack.task_log(dag_id, run_id, task_id, map_index)

    def assert_cleaned_up(self, dag_id: str, run_id: str) -> None:
        """Nothing of the run's cluster still runs and its directories (and record) are gone."""
        from airflow_provider_sky.operators._spec import default_cluster_name

        name = default_cluster_name(dag_id, run_id)
        if self.hosts is None:
            dirs = [self.sky / "local" / name]
            records = [self.sky / "local" / "clusters" / f"{name}.json"]
        else:
            homes = [Path(n.home) / ".sky_airflow" for n in self.hosts.nodes]
            dirs = [home / name for home in homes]
            records = [home / "clusters" / f"{name}.json" for home in homes]
        deadline = time.monotonic() + 5
        left = self._left(dirs)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self._left(dirs)
        _kill(left)
        assert not left, f"{dag_id}: processes of cluster {name} left: {left}"
        for path in dirs + records:
            assert not path.exists(), f"{dag_id}: {path} still exists after the teardown"

    @staticmethod
    def _left(dirs: list[Path]) -> list[tuple[int, str]]:
        """Live processes running under (or naming) one of the cluster's node directories."""
        return [proc for d in dirs for proc in processes_under(d)]


def _processes_of_job(job_id: str, command: str) -> list[int]:
    """Live processes running ``command`` with the job's ``SKYPILOT_TASK_ID`` in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
            if command not in cmd:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError):
            continue
        if f"SKYPILOT_TASK_ID={job_id}".encode() in environ:
            found.append(int(entry.name))
    return found


def _kill(procs: list[tuple[int, str]]) -> None:
    for pid, _ in procs:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.fixture(
    scope="module",
    params=[
        "local",
        pytest.param("ssh", marks=needs_sshd),
    ],
)
def real(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[RealAirflow]:
    base = tmp_path_factory.mktemp(f"airflow-real-{request.param}")
    sky = base / "sky"
    sky.mkdir()
    with contextlib.ExitStack() as cleanup:
        env = {"SKY_PROVIDER_HOME": str(sky)}
        hosts: SSHDCluster | None = None
        if request.param == "ssh":
            hosts = cleanup.enter_context(SSHDCluster(4, base))
            env["AIRFLOW_CONN_SKY_DEFAULT"] = hosts.sky_ssh_connection()
        stack = AirflowStack(base / "airflow", REPO / "dags_examples", env)
        try:
            with stack:
                run_ids = {dag_id: stack.trigger(dag_id) for dag_id in DAGS}
                yield RealAirflow(stack, sky, run_ids, hosts)
            assert not stack.leftover_processes()
            if hosts is not None:
                deadline = time.monotonic() + 10
                while hosts.rank_processes() and time.monotonic() < deadline:
                    time.sleep(0.2)
                left_hosts = hosts.rank_processes()
                for procs in left_hosts.values():
                    _kill(procs)
                assert not left_hosts, f"processes of the SSH hosts' users left: {left_hosts}"
        finally:
            left = processes_under(sky)
            _kill(left)
        assert not left, f"processes left under the services' SKY_PROVIDER_HOME {sky}: {left}"


def test_hello(real: RealAirflow) -> None:
    run_id, state = real.finished("sky_hello")
    tis = real.tis("sky_hello", run_id)
    ranks = sorted((t for (tid, _), t in tis.items() if tid == "hello.rank"), key=lambda t: t["map_index"])
    assert [t["map_index"] for t in ranks] == [0, 1, 2, 3]
    assert [t["state"] for t in ranks] == ["success"] * 4
    # started in the triggerer, no worker renders the "rank N" label: the UI shows the map index = the rank
    assert [t["rendered_map_index"] for t in ranks] == [str(i) for i in range(4)]
    for i in range(4):
        log = real.log("sky_hello", run_id, "hello.rank", i)
        assert f"rank {i} of 4" in log, log
        # started and ended in the triggerer: no worker ran the task (a worker's execute says "Attaching")
        assert "Attaching to rank" not in log and f"rank {i} (" in log and "succeeded, exit code 0" in log, (
            log
        )
        assert re.search(r"MASTER_ADDR=127\.\d+\.\d+\.\d+", log), log
        for other in set(range(4)) - {i}:
            assert f"rank {other} of 4" not in log
    assert tis[("hello.gang", -1)]["state"] == "success"
    assert tis[("hello.down", -1)]["state"] == "success"
    handle = real.stack.xcom("sky_hello", run_id, "hello.cluster")
    assert handle["backend"] == ("local" if real.hosts is None else "ssh"), handle
    if real.hosts is not None:  # one rank per host, head first
        assert [n["ip"] for n in handle["nodes"]] == [n.host for n in real.hosts.nodes], handle
    assert state == "success"
    real.assert_cleaned_up("sky_hello", run_id)


def test_fail_fast(real: RealAirflow, capsys: pytest.CaptureFixture[str]) -> None:
    run_id, state = real.finished("sky_fail_fast")
    assert state == "failed"
    tis = real.tis("sky_fail_fast", run_id)
    assert tis[("train.rank", 2)]["state"] == "failed"
    assert "exited with code 1" in real.log("sky_fail_fast", run_id, "train.rank", 2)
    for i in (0, 1, 3):
        assert tis[("train.rank", i)]["state"] == "failed"
        log = real.log("sky_fail_fast", run_id, "train.rank", i)
        assert f"rank {i} (" in log and "cancelled" in log, log
        assert re.search(r"failed: rank 2 \(\S+\) exited with code 1", log), log  # the root cause
    assert tis[("train.gang", -1)]["state"] == "failed"
    assert tis[("train.down", -1)]["state"] == "success"

    cause = real.stack.xcom("sky_fail_fast", run_id, "train.rank", "sky_rank", 2)
    assert cause["rank"] == 2 and cause["state"] == "failed" and cause["exit_code"] == 1
    run_end = parse_time(real.stack.dag_run("sky_fail_fast", run_id)["end_date"])
    assert run_end is not None
    latency = run_end - float(cause["end"])
    with capsys.disabled():
        print(f"\nsky_fail_fast under the real scheduler: rank 2 exit → run end {latency:.1f} s")
    assert 0 < latency < 30, f"the run ended {latency:.1f}s after rank 2 exited"

    real.assert_cleaned_up("sky_fail_fast", run_id)
    job_id = real.stack.xcom("sky_fail_fast", run_id, "train.job")[0]["job_id"]
    sleeps = _processes_of_job(job_id, "sleep 10000")
    _kill([(pid, "") for pid in sleeps])
    assert not sleeps, f"`sleep 10000` of job {job_id} still running: {sleeps}"


def test_segfault(real: RealAirflow) -> None:
    run_id, state = real.finished("sky_segfault")
    tis = real.tis("sky_segfault", run_id)
    assert tis[("crash.rank", 1)]["state"] == "failed"
    assert "segmentation fault (SIGSEGV)" in real.log("sky_segfault", run_id, "crash.rank", 1)
    assert tis[("crash.down", -1)]["state"] == "success"
    assert state == "failed"
    real.assert_cleaned_up("sky_segfault", run_id)


def test_failed_setup(real: RealAirflow) -> None:
    run_id, state = real.finished("sky_failed_setup")
    tis = real.tis("sky_failed_setup", run_id)
    assert tis[("train.cluster", -1)]["state"] == "failed"
    log = real.log("sky_failed_setup", run_id, "train.cluster")
    assert "FAILED_SETUP" in log, log
    assert re.search(r"Failed workers: rank 1 \(", log), log
    ranks = [t for (tid, _), t in tis.items() if tid == "train.rank"]
    # never queued: upstream_failed with no attempt (Airflow stamps start = end = when it decided)
    assert ranks and all(t["state"] == "upstream_failed" and t["try_number"] == 0 for t in ranks), ranks
    for task_id in ("train.job", "train.gang"):
        assert tis[(task_id, -1)]["state"] == "upstream_failed"
    # Airflow never runs a teardown whose setup failed (trigger rule ALL_DONE_SETUP_SUCCESS), so the
    # cluster task removed its own nodes; the cleanup check below proves nothing leaked
    assert tis[("train.down", -1)]["state"] == "upstream_failed"
    assert "Tearing down cluster" in log, log
    assert state == "failed"
    real.assert_cleaned_up("sky_failed_setup", run_id)


def test_yaml(real: RealAirflow) -> None:
    run_id, state = real.finished("sky_yaml")
    tis = real.tis("sky_yaml", run_id)
    ranks = [t for (tid, _), t in tis.items() if tid == "yaml.rank"]
    assert len(ranks) == 2 and all(t["state"] == "success" for t in ranks), ranks
    for t in ranks:
        log = real.log("sky_yaml", run_id, "yaml.rank", t["map_index"])
        assert "hello from a SkyPilot YAML" in log, log
        assert "training step" in log, log
    assert tis[("yaml.down", -1)]["state"] == "success"
    assert state == "success"
    real.assert_cleaned_up("sky_yaml", run_id)
