"""Every example DAG on a distributed Airflow: PostgreSQL, CeleryExecutor with Redis, two workers, two triggerers.

The same assertions as ``test_airflow_real`` (its tests are imported and run here against this
module's ``real`` fixture), plus ``@task.sky``'s example, on a stack where the metadata DB is a real
PostgreSQL server, tasks go through a real Redis broker to two Celery workers, and two triggerers share
the deferred rank tasks. PostgreSQL and Redis run as unprivileged processes in temp dirs
(:mod:`airflow_provider_sky.dev.services`), started here and stopped at the end of the module whatever
happens, like every Airflow service. The backend is the local one (both workers share this machine).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import pytest

from airflow_provider_sky.dev.services import PostgresServer, RedisServer
from airflow_provider_sky.dev.stack import AirflowStack, parse_time
from leaks import processes_under
from test_airflow_real import (  # noqa: F401  (imported tests run here against this module's `real`)
    DAGS,
    REPO,
    RUN_TIMEOUT,
    SEED_DAGS,
    RealAirflow,
    _dags_with_seeds,
    _kill,
    _processes_of_job,
    test_failed_setup,
    test_hello,
    test_seed_failed_worker_run,
    test_seed_failed_worker_setup,
    test_segfault,
    test_yaml,
)

pytestmark = pytest.mark.airflow_services

#: example DAGs beyond test_airflow_real's
TASKFLOW = "sky_taskflow"
TRIGGERERS = ("triggerer", "triggerer-2")


class CeleryAirflow(RealAirflow):
    """A task log as the UI shows it, plus the lines Airflow's triggerer filed in its own log instead.

    Known Airflow race (noted in test_airflow_real for Kubernetes, seen here under load too): the
    triggerer gets a trigger's log lines and its end over two sockets, and when it handles the end
    first it drops the trigger's log file, so the last lines go to ``triggerer*.log``. Every time that
    happens is counted in ``races`` and printed at the end of the module, never silently.
    """

    races: list[str]

    def log(self, dag_id: str, run_id: str, task_id: str, map_index: int = -1) -> str:
        text = super().log(dag_id, run_id, task_id, map_index)
        if "Trigger fired event" in text or "trigger completed" in text:
            return text
        mine = (f"dag_id={dag_id} ", f"run_id={run_id} ", f"map_index={map_index} ")
        filed = [
            line
            for name in TRIGGERERS
            if (self.stack.logs / f"{name}.log").exists()
            for line in (self.stack.logs / f"{name}.log").read_text(errors="replace").splitlines()
            if all(m in line + " " for m in mine)
            and ("task_id=" not in line or f"task_id={task_id} " in line + " ")
        ]
        if filed:
            self.races.append(f"{dag_id} {task_id}[{map_index}]: {len(filed)} lines in triggerer*.log")
        return "\n".join([text, *filed])


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAirflow]:
    base = tmp_path_factory.mktemp("airflow-celery")
    sky = base / "sky"
    sky.mkdir()
    dags = _dags_with_seeds(base)
    with contextlib.ExitStack() as cleanup:
        postgres = cleanup.enter_context(PostgresServer())
        redis = cleanup.enter_context(RedisServer())
        stack = AirflowStack(
            base / "airflow",
            dags,
            {"SKY_PROVIDER_HOME": str(sky)},
            sql_alchemy_conn=postgres.url,
            broker_url=redis.url,
            celery_workers=2,
            triggerers=2,
        )
        try:
            with stack:
                run_ids = {dag_id: stack.trigger(dag_id) for dag_id in (*DAGS, *SEED_DAGS, TASKFLOW)}
                celery = CeleryAirflow(stack, sky, run_ids)
                celery.races = []
                yield celery
            if celery.races:
                print(
                    f"\n{len(celery.races)} task log(s) lacked their trigger's last lines (filed in the "
                    "triggerer's own log by Airflow's log/event race): " + "; ".join(celery.races)
                )
            assert not stack.leftover_processes()
        finally:
            left = processes_under(sky)
            _kill(left)
        assert not left, f"processes left under the services' SKY_PROVIDER_HOME {sky}: {left}"
    # the servers stopped with the ExitStack: nothing of theirs may be left either
    for server in (postgres, redis):
        assert not server.alive(), f"{server.name} still running"


def test_the_stack_is_distributed(real: RealAirflow) -> None:
    """What this module claims to test: PostgreSQL, Celery with two workers, two triggerers, all alive."""
    stack = real.stack
    assert stack.executor == "CeleryExecutor"
    assert stack.env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql+psycopg2://")
    assert stack.env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://127.0.0.1:")
    assert set(stack.procs) >= {"celery-worker-1", "celery-worker-2", *TRIGGERERS}
    health = stack.health()
    assert health["metadatabase"]["status"] == "healthy" and health["triggerer"]["status"] == "healthy"


def test_taskflow(real: RealAirflow) -> None:
    """dags_examples/sky_taskflow.py (``@task.sky``) through Celery: the command task's value on every rank."""
    run_id, state = real.finished(TASKFLOW)
    tis = real.tis(TASKFLOW, run_id)
    assert state == "success", tis
    assert [tis[("train.rank", i)]["state"] for i in range(4)] == ["success"] * 4
    for task_id in ("steps", "train.command", "train.cluster", "train.job", "train.gang", "train.down"):
        assert tis[(task_id, -1)]["state"] == "success", task_id
    command = real.stack.xcom(TASKFLOW, run_id, "train.command")
    assert f"run {run_id}" in command and "3 steps" in command, command
    for i in range(4):
        log = real.log(TASKFLOW, run_id, "train.rank", i)
        assert re.search(
            rf"rank {i} of 4: 3 steps, master 127\.\d+\.\d+\.1:29512, run {re.escape(run_id)}", log
        ), log
    real.assert_cleaned_up(TASKFLOW, run_id)


def test_fail_fast(real: RealAirflow, capsys: pytest.CaptureFixture[str]) -> None:
    """test_airflow_real's test_fail_fast, but the bound is on the failure (the gang task's end), not the
    run's end: through Celery the teardown task's own queueing adds seconds a user waits for cleanup,
    not for the verdict (both printed)."""
    run_id, state = real.finished("sky_fail_fast")
    assert state == "failed"
    tis = real.tis("sky_fail_fast", run_id)
    assert tis[("train.rank", 2)]["state"] == "failed"
    assert "exited with code 1" in real.log("sky_fail_fast", run_id, "train.rank", 2)
    for i in (0, 1, 3):
        assert tis[("train.rank", i)]["state"] == "failed"
        other = real.stack.xcom("sky_fail_fast", run_id, "train.rank", "sky_rank", i)
        assert other["state"] == "cancelled", other
        log = real.log("sky_fail_fast", run_id, "train.rank", i)
        assert f"rank {i} (" in log and "cancelled" in log, log
        assert re.search(r"rank 2 \(\S+\) exited with code 1|rank 2 failed first", log), log  # the root cause
    assert tis[("train.gang", -1)]["state"] == "failed"
    assert tis[("train.down", -1)]["state"] == "success"
    cause = real.stack.xcom("sky_fail_fast", run_id, "train.rank", "sky_rank", 2)
    assert cause["rank"] == 2 and cause["state"] == "failed" and cause["exit_code"] == 1
    gang_end = parse_time(tis[("train.gang", -1)]["end_date"])
    run_end = parse_time(real.stack.dag_run("sky_fail_fast", run_id)["end_date"])
    assert gang_end is not None and run_end is not None
    decided, ended = gang_end - float(cause["end"]), run_end - float(cause["end"])
    with capsys.disabled():
        print(
            f"\nsky_fail_fast on Celery: rank 2 exit → gang failed {decided:.1f} s, → run end {ended:.1f} s"
        )
    assert 0 < decided < 30, f"the gang failed {decided:.1f}s after rank 2 exited"
    real.assert_cleaned_up("sky_fail_fast", run_id)
    job_id = real.stack.xcom("sky_fail_fast", run_id, "train.job")[0]["job_id"]
    assert not _processes_of_job(job_id, "sleep 10000")


def test_both_workers_ran_tasks(real: RealAirflow, capsys: pytest.CaptureFixture[str]) -> None:
    """The runs spread over both Celery workers (none queued behind one); prints each run's duration."""
    lines = []
    for dag_id in (*DAGS, *SEED_DAGS, TASKFLOW):
        run_id, state = real.finished(dag_id)
        run = real.stack.dag_run(dag_id, run_id)
        start, end = parse_time(run["start_date"]), parse_time(run["end_date"])
        assert start is not None and end is not None
        lines.append(f"{dag_id}: {state} in {end - start:.1f} s")
    with capsys.disabled():
        print("\nrun times on PostgreSQL + Celery (2 workers) + 2 triggerers:\n  " + "\n  ".join(lines))
    for worker in ("celery-worker-1", "celery-worker-2"):
        text = (real.stack.logs / f"{worker}.log").read_text(errors="replace")
        received = len(re.findall(r"Task execute_workload\[[^\]]+\] received", text))
        assert received > 0, f"{worker} ran no task:\n{text[-2000:]}"
