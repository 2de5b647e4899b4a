"""One gang's triggers spread over two triggerers: each triggerer polls the gang once per interval, and the
failure is cancelled without a storm of cancels.

A real stack (api-server, scheduler, dag-processor and two triggerers, SQLite) whose triggerers hold at most
three triggers each (``[triggerer] capacity = 3``), so a gang of four ranks (four rank triggers and the gang
sensor's) cannot sit on one: both triggerers watch it. Each triggerer's triggers of one job share one poll
(Airflow's shared streams): the node sees at most one status call per interval from each triggerer, never
one per trigger. Polls are counted where they land: every status call writes its time into the rank's
``polled`` file on the node (the dead-man's switch reads it), which the test samples every 10 ms.

The same stack with both triggerers stopped: a rank task marked failed then still stops the gang, once a
triggerer runs the gang sensor's trigger again.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from leaks import job_processes

from airflow_provider_sky.triggers.task_states import LOOK_EVERY
from devstack.stack import AirflowStack
from e2e.test_airflow_celery import MOVE, TRIGGERERS, _wait_all_deferred
from e2e.test_airflow_real import REPO, RUN_TIMEOUT, RealAirflow, _kill, _processes_of_job

pytestmark = pytest.mark.airflow_services

CAPACITY = 3
POLL_INTERVAL = 0.5  # sky_gang's default, which sky_rel_triggerer_move keeps


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealAirflow]:
    base = tmp_path_factory.mktemp("airflow-triggerers")
    sky = base / "sky"
    sky.mkdir()
    dags = base / "dags"
    dags.mkdir()
    (dags / f"{MOVE}.py").symlink_to(REPO / "tests" / "dags" / f"{MOVE}.py")
    stack = AirflowStack(
        base / "airflow",
        dags,
        {"SKY_PROVIDER_HOME": str(sky), "AIRFLOW__TRIGGERER__CAPACITY": str(CAPACITY)},
        triggerers=2,
    )
    try:
        with stack:
            yield RealAirflow(stack, sky, {})
        assert not stack.leftover_processes()
    finally:
        left = job_processes(sky)
        _kill(left)
    assert not left, f"processes left under SKY_PROVIDER_HOME {sky}: {left}"


def _trigger_started(run_logs: Path, task_id: str, map_index: int) -> bool:
    """Whether a triggerer started the task's trigger (Airflow's "trigger ... starting" in its trigger log)."""
    where = run_logs / f"task_id={task_id}"
    if map_index >= 0:
        where = where / f"map_index={map_index}"
    for path in where.glob("attempt=1.log.trigger.*.log"):
        with contextlib.suppress(OSError):
            if " starting" in path.read_text(errors="replace"):
                return True
    return False


def _polls(polled: Path, seconds: float) -> list[str]:
    """The distinct poll times written into a rank's ``polled`` file during ``seconds``."""
    seen: list[str] = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            value = polled.read_text().strip()
            if value and (not seen or seen[-1] != value):
                seen.append(value)
        time.sleep(0.01)
    return seen


def test_a_gang_on_two_triggerers_is_polled_once_per_interval_by_each(
    real: RealAirflow, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = real.stack
    go = real.sky.parent / "go-rank-2-fail-split"
    run_id = stack.trigger(MOVE, conf={"go": str(go)})
    keys = [("gang.rank", i) for i in range(4)] + [("gang.gang", -1)]
    held = _wait_all_deferred(stack, run_id, keys)
    holders = {job for _, job in held.values()}
    assert len(holders) == 2, f"the gang's five triggers should be spread over both triggerers: {held}"
    assert sorted(stack.triggerer_jobs().values()) == sorted(TRIGGERERS)

    job_id = stack.xcom(MOVE, run_id, "gang.job")[0]["job_id"]
    polled = next(real.sky.rglob(f"jobs/{job_id}/0/polled"))
    # deferred is not yet polling: each triggerer loads the DAG of every start-from-trigger task first
    run_logs = stack.logs / f"dag_id={MOVE}" / f"run_id={run_id}"
    deadline = time.monotonic() + RUN_TIMEOUT
    while not all(_trigger_started(run_logs, task_id, i) for task_id, i in keys):
        assert time.monotonic() < deadline, (
            f"not every trigger started: {sorted(run_logs.rglob('*trigger*'))}"
        )
        time.sleep(0.5)
    # and a started trigger polls only once it has read the cluster handle (the first XCom read through a
    # triggerer starts its in-process API server: seconds): wait until both triggerers' polls land
    warm = _polls(polled, 3.0)
    while len(warm) < 1.5 * 3.0 / POLL_INTERVAL:
        assert time.monotonic() < deadline, f"the two triggerers never both polled: {len(warm)} polls in 3 s"
        warm = _polls(polled, 3.0)
    window = 10.0
    polls = _polls(polled, window)
    per_interval = len(polls) / (window / POLL_INTERVAL)
    # one shared poll per triggerer: about 2 per interval (a poll outlasting the interval makes it fewer);
    # one poll per trigger would be 5
    assert len(polls) <= 2 * window / POLL_INTERVAL * 1.25 + 2, f"{len(polls)} polls in {window} s: {polls}"
    assert len(polls) >= 4, f"the triggers hardly poll: {polls}"

    go.touch()
    assert stack.wait_run(MOVE, run_id, timeout=RUN_TIMEOUT) == "failed"
    cause = stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", 2)
    others = [stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", i) for i in (0, 1, 3)]
    assert cause["state"] == "failed" and [o["state"] for o in others] == ["cancelled"] * 3, others
    cancelled = max(float(o["end"]) for o in others) - float(cause["end"])
    # who sent a cancel: a triggerer's shared poll that saw the failure before the node held a cancel (its
    # log line lands in the log of the trigger whose context runs the shared poll, or in the triggerer's)
    pattern = re.compile(rf"cancelling ranks [^\n]* of job {re.escape(job_id)}")
    sent = sum(
        len(pattern.findall(p.read_text(errors="replace")))
        for p in [
            *(stack.logs / f"{name}.log" for name in TRIGGERERS),
            *(stack.logs / f"dag_id={MOVE}").rglob("*.log"),
        ]
    )
    reasons = {o["reason"] for o in others}
    with capsys.disabled():
        print(
            f"\ngang on two triggerers: {len(polls)} polls of rank 0 in {window:.0f} s "
            f"({per_interval:.2f} per {POLL_INTERVAL} s interval); rank 2 exit -> siblings cancelled "
            f"{cancelled:.2f} s; fail-fast cancels sent: {sent}; reasons: {sorted(reasons)}"
        )
    assert all("rank 2 failed first" in r for r in reasons), reasons
    # (a line Airflow's log/event race moved is not counted: at most, never at least)
    assert sent <= len(TRIGGERERS), f"{sent} fail-fast cancels for one failure (at most one per triggerer)"
    assert cancelled < 3.0, f"siblings still ran {cancelled:.1f} s after rank 2 failed"
    assert not _processes_of_job(job_id, "sleep 10000")
    real.assert_cleaned_up(MOVE, run_id)


def test_a_rank_marked_failed_while_no_triggerer_runs_stops_the_gang_once_one_does(
    real: RealAirflow, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user marks rank 1's task failed while every triggerer is down (a restart of all of them): its
    trigger, run by none, never gets the cancel, and Airflow drops it. The ranks run on (nothing tells
    them); the gang trigger, once a triggerer runs it again, finds the rank task failed with its rank
    still running and stops the gang, saying why."""
    stack = real.stack
    run_id = stack.trigger(MOVE, conf={"go": str(real.sky.parent / "never-told")})
    keys = [("gang.rank", i) for i in range(4)] + [("gang.gang", -1)]
    _wait_all_deferred(stack, run_id, keys)
    job_id = stack.xcom(MOVE, run_id, "gang.job")[0]["job_id"]
    assert len(_processes_of_job(job_id, "sleep 10000")) == 3  # ranks 0, 1 and 3 (2 waits for its file)

    for service in TRIGGERERS:
        stack.kill_service(service, signal.SIGTERM)  # every triggerer stops; their triggers are released
    stack.mark_failed(MOVE, run_id, "gang.rank", 1)
    time.sleep(2 * LOOK_EVERY)
    assert len(_processes_of_job(job_id, "sleep 10000")) == 3, "something else stopped the gang"

    stack.restart_triggerers()
    up = time.monotonic()
    while _processes_of_job(job_id, "sleep 10000") and time.monotonic() - up < RUN_TIMEOUT:
        time.sleep(0.1)
    gone = time.monotonic() - up
    assert not _processes_of_job(job_id, "sleep 10000"), (
        "the gang ran on after the rank task was marked failed"
    )
    assert stack.wait_run(MOVE, run_id, timeout=RUN_TIMEOUT) == "failed"
    with capsys.disabled():
        print(
            f"\nrank task marked failed with no triggerer: ranks gone {gone:.1f} s after the triggerers were up"
        )
    why = "was marked failed or marked success by a user, and its own trigger did not stop the gang"
    for rank in (0, 2, 3):
        outcome = stack.xcom(MOVE, run_id, "gang.rank", "sky_rank", rank)
        assert outcome["state"] == "cancelled" and why in outcome["reason"], outcome
        assert "rank task gang.rank [rank 1] (failed)" in outcome["reason"], outcome
    tis = real.tis(MOVE, run_id)
    assert tis[("gang.rank", 1)]["state"] == "failed"
    assert tis[("gang.gang", -1)]["state"] == "failed"
    assert tis[("gang.down", -1)]["state"] == "success"
    real.assert_cleaned_up(MOVE, run_id)
