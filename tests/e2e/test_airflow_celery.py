"""Every example DAG on a distributed Airflow: PostgreSQL, CeleryExecutor with Redis, two workers, two triggerers.

The same assertions as ``test_airflow_real`` (its tests, and the pipeline's of
``e2e/pipeline_checks.py``, are imported and run here against this module's ``real`` fixture), plus
``@task.sky``'s example, on a stack where the metadata DB is a real
PostgreSQL server, tasks go through a real Redis broker to two Celery workers, and two triggerers share
the deferred rank tasks. PostgreSQL and Redis run as unprivileged processes in temp dirs
(:mod:`devstack.services`), started here and stopped at the end of the module whatever
happens, like every Airflow service. The backend is the local one (both workers share this machine).

Last, a fault: the triggerer that watches a running gang is killed (SIGKILL, a crash); its triggers
move to the other triggerer, nothing is cancelled by the move, and a rank failure after it still
fails the gang fast.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from leaks import job_processes

from devstack.services import PostgresServer, RedisServer
from devstack.stack import AirflowStack, StackError, parse_time
from e2e.pipeline_checks import (  # noqa: F401  (the pipeline's checks run here too, against `real`)
    pipeline,
    test_a_failed_gang_pushes_no_result_and_emits_no_event,
    test_an_invalid_form_value_is_refused_before_provisioning,
    test_the_chain_runs_end_to_end,
    test_without_outlets_the_triggerer_pushes_the_last_line,
)
from e2e.test_airflow_real import (  # noqa: F401  (imported tests run here against this module's `real`)
    DAGS,
    REPO,
    RUN_TIMEOUT,
    SEED_DAGS,
    RealAirflow,
    _dags_with_seeds,
    _kill,
    _processes_of_job,
    test_failed_setup,
    test_hang,
    test_hello,
    test_retry,
    test_seed_failed_worker_run,
    test_seed_failed_worker_setup,
    test_segfault,
    test_yaml,
)

pytestmark = pytest.mark.airflow_services

#: example DAGs beyond test_airflow_real's
TASKFLOW = "sky_taskflow"
MOVE = "sky_rel_triggerer_move"
#: the job task hangs after the launch on try 1 (tests/dags/sky_rel_reattach.py), here on the local backend
REATTACH = "sky_rel_reattach"
TRIGGERERS = ("triggerer", "triggerer-2")


class CeleryAirflow(RealAirflow):
    """The real stack's view (task logs with the lines Airflow's triggerer filed in its own log: see
    :meth:`RealAirflow.log`) on PostgreSQL, Celery and two triggerers."""


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAirflow]:
    base = tmp_path_factory.mktemp("airflow-celery")
    sky = base / "sky"
    sky.mkdir()
    dags = _dags_with_seeds(base)
    for dag_id in (MOVE, REATTACH):
        (dags / f"{dag_id}.py").symlink_to(REPO / "tests" / "dags" / f"{dag_id}.py")
    with contextlib.ExitStack() as cleanup:
        postgres = cleanup.enter_context(PostgresServer())
        redis = cleanup.enter_context(RedisServer())
        stack = AirflowStack(
            base / "airflow",
            dags,
            {
                "SKY_PROVIDER_HOME": str(sky),
                # sky_rel_reattach's connection, here the local backend (both workers share this machine)
                "AIRFLOW_CONN_SKY_REL_SSH": json.dumps({"conn_type": "sky_local"}),
                # a task whose Celery worker died fails after this and is retried (Airflow's default: 300 s)
                "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT": "45",
            },
            sql_alchemy_conn=postgres.url,
            broker_url=redis.url,
            celery_workers=2,
            triggerers=2,
            ready_timeout=300,  # eight processes start at once on 2 cores
        )
        try:
            with stack:
                run_ids = {dag_id: stack.trigger(dag_id) for dag_id in (*DAGS, *SEED_DAGS, TASKFLOW)}
                celery = CeleryAirflow(stack, sky, run_ids)
                yield celery
            if celery.races:
                print(
                    f"\n{len(celery.races)} task log(s) lacked their trigger's last lines (filed in the "
                    "triggerer's own log by Airflow's log/event race): " + "; ".join(celery.races)
                )
            assert not stack.leftover_processes()
        finally:
            left = job_processes(sky)
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
    # the siblings die within a second whatever the load (the launch-side watcher); the gang task's verdict
    # waits for the triggerer to load the gang's triggers, which a burst of ten DAGs on 2 busy cores delays
    # (12-29 s seen): a bound on Airflow's latency here, the speed goals are measured by make bench
    assert 0 < decided < 60, f"the gang failed {decided:.1f}s after rank 2 exited"
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


def _triggerer_ids(
    stack: AirflowStack, dag_id: str, run_id: str, keys: list[tuple[str, int]]
) -> dict[Any, Any]:
    """(state, triggerer job id) of each task instance."""
    out = {}
    for task_id, map_index in keys:
        try:
            ti = stack.task_instance(dag_id, run_id, task_id, map_index)
        except StackError as exc:  # the rank tasks exist once the job task's output expanded them
            if "-> 404" not in str(exc):
                raise
            ti = {"state": None}
        out[(task_id, map_index)] = (ti["state"], (ti.get("trigger") or {}).get("triggerer_id"))
    return out


def _wait_all_deferred(
    stack: AirflowStack, run_id: str, keys: list[tuple[str, int]]
) -> dict[tuple[str, int], tuple[Any, Any]]:
    """Wait until every task of ``keys`` is deferred on a triggerer; their (state, triggerer job id)."""
    deadline = time.monotonic() + RUN_TIMEOUT
    held: dict[tuple[str, int], tuple[Any, Any]] = {}
    while not held or not all(state == "deferred" and job for state, job in held.values()):
        assert time.monotonic() < deadline, f"the gang's tasks never all deferred: {held}"
        try:
            held = _triggerer_ids(stack, MOVE, run_id, keys)
            assert stack.dag_run(MOVE, run_id)["state"] in ("queued", "running"), held
        except httpx.TimeoutException:  # an api-server busy past its 30 s read timeout: ask again
            held = {}
        time.sleep(0.5)
    return held


@dataclass
class MoveGang:
    """A running ``sky_rel_triggerer_move`` gang: every task deferred, ranks 0, 1, 3 sleeping, rank 2
    waiting for ``go`` to fail."""

    run_id: str
    go: Path
    keys: list[tuple[str, int]]
    held: dict[tuple[str, int], tuple[Any, Any]]
    job_id: str
    sleeps: list[int]


def _start_move_gang(real: RealAirflow, go_name: str) -> MoveGang:
    stack = real.stack
    go = real.sky.parent / go_name
    run_id = stack.trigger(MOVE, conf={"go": str(go)})
    keys = [("gang.rank", i) for i in range(4)] + [("gang.gang", -1)]
    held = _wait_all_deferred(stack, run_id, keys)
    job_id = stack.xcom(MOVE, run_id, "gang.job")[0]["job_id"]
    sleeps = sorted(_processes_of_job(job_id, "sleep 10000"))
    assert len(sleeps) == 3, f"ranks 0, 1 and 3 should each run one sleep: {sleeps}"
    return MoveGang(run_id, go, keys, held, job_id, sleeps)


#: [triggerer] triggerer_health_check_threshold for the move tests (the stack starts with 60 s, see
#: devstack/services.py). The threshold is what an adopting triggerer reads: it takes a triggerer whose
#: heartbeat (every 2 s) is older than this for dead. The 60 s covers the stall of a live triggerer loading
#: the burst of the module's ten DAG runs (about 50 triggers: 12-15 s on 2 cores, 45-51 s at a load
#: average of 45). Those runs have all ended before the threshold is lowered (:func:`quick_moves` waits
#: for them), and a move gang's 5 triggers are a tenth of that burst (about 1.5 s; 5 s at a load of 45, if
#: the stall scales with the count), so 20 s keeps a live triggerer's stall under it with a margin of 4x,
#: while a dead or stopped triggerer's triggers move about 40 s sooner in each of the three tests.
MOVE_THRESHOLD = 20


@pytest.fixture(scope="module")
def quick_moves(real: RealAirflow) -> int:
    """Both triggerers started again with :data:`MOVE_THRESHOLD` (and every triggerer started later),
    once every run the module started with has ended (its burst of triggers is what needs the 60 s)."""
    for dag_id, run_id in real.run_ids.items():
        real.stack.wait_run(dag_id, run_id, timeout=RUN_TIMEOUT)
    real.stack.restart_triggerers(
        {"AIRFLOW__TRIGGERER__TRIGGERER_HEALTH_CHECK_THRESHOLD": str(MOVE_THRESHOLD)}
    )
    return MOVE_THRESHOLD


def test_a_stalled_triggerer_that_resumes_cancels_nothing(
    real: RealAirflow, quick_moves: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """A triggerer stalls (SIGSTOP) past the health threshold, the other adopts its triggers, then it
    resumes: Airflow cancels its stale copies with the *user-action* signal (``on_kill``), but the task
    instances are still deferred, so the gang keeps running; a later failure still fails it fast."""
    stack = real.stack
    g = _start_move_gang(real, "go-rank-2-fail-after-stall")
    run_id, go, keys, held, job_id, sleeps = g.run_id, g.go, g.keys, g.held, g.job_id, g.sleeps

    stalled_job = held[("gang.rank", 0)][1]
    stalled = stack.triggerer_jobs()[stalled_job]
    moved = [k for k, (_, job) in held.items() if job == stalled_job]
    stack.signal_service(stalled, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        now = _triggerer_ids(stack, MOVE, run_id, keys)
        while any(now[k][1] == stalled_job for k in moved):
            assert time.monotonic() - stopped_at < 150, f"triggers not adopted 150 s into the stall: {now}"
            time.sleep(0.5)
            now = _triggerer_ids(stack, MOVE, run_id, keys)
    finally:
        stack.signal_service(stalled, signal.SIGCONT)
    adopted = time.monotonic() - stopped_at

    # the resumed triggerer cancels its stale copies with the user-action signal: Airflow logs "Trigger
    # cancelled by user action, invoking on_kill" in each moved task's log, then the copy's end
    def stale_copies_ended() -> bool:
        for task_id, i in moved:
            text = real.log(MOVE, run_id, task_id, i)
            at = text.find("Trigger cancelled by user action, invoking on_kill")
            if at < 0 or "trigger completed" not in text[at:]:
                return False
        return True

    deadline = time.monotonic() + 90
    while not stale_copies_ended():
        assert time.monotonic() < deadline, (
            "the resumed triggerer never cancelled its stale copies: "
            + (real.log(MOVE, run_id, *moved[0])[-3000:])
        )
        time.sleep(1)
    time.sleep(3)  # a few polls after the stale copies' on_kill (which would have cancelled at once)
    assert sorted(_processes_of_job(job_id, "sleep 10000")) == sleeps, "the resumed triggerer cancelled ranks"
    assert all(state == "deferred" for state, _ in _triggerer_ids(stack, MOVE, run_id, keys).values())
    for i in range(4):
        assert stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", i) is None, f"rank {i} reported an end"

    go.touch()
    state = stack.wait_run(MOVE, run_id, timeout=RUN_TIMEOUT)
    assert state == "failed"
    cause = stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", 2)
    assert cause["state"] == "failed" and cause["exit_code"] == 1, cause
    others = [stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", i) for i in (0, 1, 3)]
    assert [o["state"] for o in others] == ["cancelled"] * 3, others
    cancelled = max(float(o["end"]) for o in others) - float(cause["end"])
    with capsys.disabled():
        print(
            f"\n{stalled} stalled: {len(moved)} triggers adopted in {adopted:.1f} s, its stale copies "
            f"cancelled nothing; then rank 2 exit → siblings cancelled {cancelled:.2f} s"
        )
    assert cancelled < 3.0, f"siblings still ran {cancelled:.1f} s after rank 2 failed"
    assert not _processes_of_job(job_id, "sleep 10000")
    real.assert_cleaned_up(MOVE, run_id)


def test_killing_a_triggerer_moves_its_triggers_and_cancels_nothing(
    real: RealAirflow, quick_moves: int, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = real.stack
    g = _start_move_gang(real, "go-rank-2-fail")
    run_id, go, keys, held, job_id, sleeps = g.run_id, g.go, g.keys, g.held, g.job_id, g.sleeps

    victim_job = held[("gang.rank", 0)][1]
    jobs = stack.triggerer_jobs()
    assert sorted(jobs.values()) == sorted(TRIGGERERS), jobs
    victim = jobs[victim_job]
    moved = [k for k, (_, job) in held.items() if job == victim_job]
    killed_at = time.monotonic()
    stack.kill_service(victim)  # SIGKILL to its process group: a crash, nothing released in the DB

    # Airflow gives a dead triggerer's triggers to a live one once its heartbeat is older than
    # [triggerer] triggerer_health_check_threshold (MOVE_THRESHOLD here, see quick_moves)
    now = _triggerer_ids(stack, MOVE, run_id, keys)
    while any(now[k][1] == victim_job for k in moved):
        assert all(state == "deferred" for state, _ in now.values()), f"the move changed a task: {now}"
        assert time.monotonic() - killed_at < 150, f"triggers not adopted 150 s after the kill: {now}"
        time.sleep(0.5)
        now = _triggerer_ids(stack, MOVE, run_id, keys)
    move_took = time.monotonic() - killed_at
    survivors = {job for _, job in now.values()}
    assert len(survivors) == 1 and victim_job not in survivors, now
    assert jobs[survivors.pop()] != victim

    # nothing was cancelled by the move: the same processes run, every task is still deferred
    time.sleep(3)  # a few polls of the adopted triggers
    assert sorted(_processes_of_job(job_id, "sleep 10000")) == sleeps
    assert all(state == "deferred" for state, _ in _triggerer_ids(stack, MOVE, run_id, keys).values())
    for i in range(4):
        assert stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", i) is None, f"rank {i} reported an end"

    go.touch()  # now rank 2 fails: the adopted triggers must fail the gang fast
    state = stack.wait_run(MOVE, run_id, timeout=RUN_TIMEOUT)
    tis = real.tis(MOVE, run_id)
    assert state == "failed"
    cause = stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", 2)
    assert cause["state"] == "failed" and cause["exit_code"] == 1, cause
    assert tis[("gang.rank", 2)]["state"] == "failed"
    others = [stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", i) for i in (0, 1, 3)]
    assert [o["state"] for o in others] == ["cancelled"] * 3, others
    assert all(tis[("gang.rank", i)]["state"] == "failed" for i in (0, 1, 3))
    for i in (0, 1, 3):
        log = real.log(MOVE, run_id, "gang.rank", i)
        assert re.search(r"rank 2 \(\S+\) exited with code 1|rank 2 failed first", log), log
    assert tis[("gang.gang", -1)]["state"] == "failed"
    assert tis[("gang.down", -1)]["state"] == "success"
    cancelled = max(float(o["end"]) for o in others) - float(cause["end"])
    gang_end = parse_time(tis[("gang.gang", -1)]["end_date"])
    assert gang_end is not None
    decided = gang_end - float(cause["end"])
    with capsys.disabled():
        print(
            f"\n{victim} killed: {len(moved)} triggers moved in {move_took:.1f} s; then rank 2 exit → "
            f"siblings cancelled {cancelled:.2f} s, → gang task failed {decided:.1f} s"
        )
    assert cancelled < 3.0, f"siblings still ran {cancelled:.1f} s after rank 2 failed"
    assert 0 < decided < 30, f"the gang failed {decided:.1f} s after rank 2 exited"
    assert not _processes_of_job(job_id, "sleep 10000")
    real.assert_cleaned_up(MOVE, run_id)


def test_a_rank_failing_while_no_triggerer_runs_is_cancelled_by_the_launch_side_watcher(
    real: RealAirflow, quick_moves: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """The gap of the move: the last triggerer is killed, then rank 2 fails before any triggerer runs.

    Something still stops the gang: here (every local rank on one machine) the machine itself, else the
    job task's launch-side watcher (tests/integration/test_bridge.py has both): the siblings are cancelled at once;
    the triggerer started afterwards adopts the triggers, which report the outcome and fail the gang.
    """
    stack = real.stack
    go = real.sky.parent / "go-rank-2-fail-in-the-gap"
    run_id = stack.trigger(MOVE, conf={"go": str(go)})
    keys = [("gang.rank", i) for i in range(4)] + [("gang.gang", -1)]
    _wait_all_deferred(stack, run_id, keys)
    job_id = stack.xcom(MOVE, run_id, "gang.job")[0]["job_id"]
    assert len(_processes_of_job(job_id, "sleep 10000")) == 3

    for service in [s for s in TRIGGERERS if s in stack.procs]:
        stack.kill_service(service)  # no triggerer left
    go.touch()
    told = time.monotonic()
    while _processes_of_job(job_id, "sleep 10000") and time.monotonic() - told < 30:
        time.sleep(0.05)
    gone = time.monotonic() - told
    assert not _processes_of_job(job_id, "sleep 10000"), "nothing cancelled the siblings without a triggerer"

    stack.restart_triggerer()  # a triggerer again: it adopts the dead one's triggers after the threshold
    state = stack.wait_run(MOVE, run_id, timeout=RUN_TIMEOUT)
    tis = real.tis(MOVE, run_id)
    with capsys.disabled():
        print(
            f"\nno triggerer: rank 2 told to fail → siblings gone {gone:.2f} s (the machine or the launch-side watcher)"
        )
    assert gone < 5.0, f"siblings ran {gone:.1f} s after rank 2 was told to fail"
    assert state == "failed"
    cause = stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", 2)
    assert cause["state"] == "failed" and cause["exit_code"] == 1, cause
    others = [stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", i) for i in (0, 1, 3)]
    assert [o["state"] for o in others] == ["cancelled"] * 3, others
    assert all(tis[("gang.rank", i)]["state"] == "failed" for i in range(4))
    assert tis[("gang.gang", -1)]["state"] == "failed"
    assert tis[("gang.down", -1)]["state"] == "success"
    real.assert_cleaned_up(MOVE, run_id)


def _ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent... up to init."""
    out = []
    while pid > 1:
        try:
            pid = int(Path(f"/proc/{pid}/status").read_text().split("PPid:", 1)[1].split()[0])
        except (OSError, IndexError, ValueError):
            break
        out.append(pid)
    return out


def test_killing_the_celery_worker_after_the_launch_reattaches(
    real: RealAirflow, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Celery worker running the job task dies (SIGKILL to its process group) once every rank
    started: the task's heartbeat stops, Airflow fails try 1 and the other worker's try 2 re-attaches to
    try 1's job; each rank was started once; the run succeeds and nothing is left."""
    stack = real.stack
    tag = f"celery-{time.monotonic_ns() % 10**8}"
    pid_file = tmp_path / "job.pid"
    run_id = stack.trigger(REATTACH, conf={"pid_file": str(pid_file), "tag": tag})
    deadline = time.monotonic() + RUN_TIMEOUT
    while not (pid_file.exists() and pid_file.read_text().strip()):
        assert time.monotonic() < deadline, "the job task never reached its launch"
        time.sleep(0.2)
    pid = int(pid_file.read_text())

    def counts() -> list[str]:
        return sorted(p.read_text() for p in real.sky.rglob(f"rel-{tag}.count"))

    while len(counts()) < 4:
        assert time.monotonic() < deadline, f"not every rank started: {counts()}"
        time.sleep(0.2)
    workers = {stack.procs[w].pid: w for w in stack.procs if w.startswith("celery-worker")}
    worker = next((workers[p] for p in _ancestors(pid) if p in workers), None)
    assert worker is not None, f"the job task {pid} runs under no Celery worker {workers}"
    ti = stack.task_instance(REATTACH, run_id, "g.job", -1)
    assert ti["state"] == "running" and ti["try_number"] == 1, ti

    stack.kill_service(worker)  # the worker's machine crashed: no task process, no supervisor
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # the task process too, wherever Airflow put its process group
    killed = time.monotonic()
    try:
        while True:
            ti = stack.task_instance(REATTACH, run_id, "g.job", -1)
            assert ti["state"] != "failed", f"the job task failed instead of retrying: {ti}"
            if ti["try_number"] == 2 and ti["state"] == "success":
                break
            assert time.monotonic() - killed < 240, f"no try 2 of the job task 240 s after the kill: {ti}"
            time.sleep(0.5)
        reattached = time.monotonic() - killed
        log2 = stack.task_log(REATTACH, run_id, "g.job", try_number=2)
        started = counts()  # before the teardown removes the nodes' homes
        for path in real.sky.rglob(f"rel-{tag}.count"):
            path.with_name(f"rel-{tag}.go").touch()
        assert stack.wait_run(REATTACH, run_id, timeout=RUN_TIMEOUT) == "success"
    finally:
        stack.start_service(worker)  # the later tests keep two workers
    tis = real.tis(REATTACH, run_id)
    assert [tis[("g.rank", i)]["state"] for i in range(4)] == ["success"] * 4
    assert tis[("g.down", -1)]["state"] == "success"
    job_id = stack.xcom(REATTACH, run_id, "g.job")[0]["job_id"]
    assert job_id.endswith("-t1"), job_id  # try 1's job, re-attached
    assert started == [f"{job_id}\n"] * 4, f"each rank must start exactly once: {started}"
    assert "Reconnecting to existing job" in log2 and "Starting 4 rank(s)" not in log2, log2
    with capsys.disabled():
        print(f"\n{worker} killed after the launch: try 2 re-attached {reattached:.1f} s later")
    real.assert_cleaned_up(REATTACH, run_id)
