"""The resume hold (apache/airflow#72716 workaround) stays on Airflow 3.3 and goes with a fixed scheduler.

Read from the installed scheduler's own source: Airflow 3.3.2 fails a deferred task whose stale
defer-exit success is processed once the resumed attempt is RUNNING, so a worker that defers holds its
watcher's event; a scheduler whose requeue guard covers RUNNING (the fix, PR #72767, in no release yet)
needs no hold.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from airflow_provider_sky import compat


def _scheduler_source() -> str:
    spec = importlib.util.find_spec("airflow.jobs.scheduler_job_runner")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).read_text()


#: the resume-after-defer guard of Airflow 3.3.2's ``process_executor_events``
GUARD_3_3 = """                    ti.state == TaskInstanceState.SCHEDULED
                    and state == TaskInstanceState.SUCCESS"""
#: the same guard as PR #72767 extends it (SCHEDULED, QUEUED and RUNNING)
GUARD_FIXED = """                    ti.state
                    in (TaskInstanceState.SCHEDULED, TaskInstanceState.QUEUED, TaskInstanceState.RUNNING)
                    and state == TaskInstanceState.SUCCESS"""


def test_installed_airflow_keeps_the_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this Airflow (3.3.2, no fix) a deferring worker's watcher holds its event past the window in
    which the stale report can land: ``[workers] min_heartbeat_interval`` + 2 s."""
    source = _scheduler_source()
    assert GUARD_3_3 in source, "the scheduler's guard changed: check apache/airflow#72716's status"
    assert not compat.requeue_guard_covers_running(source)
    compat.scheduler_ignores_stale_defer_success.cache_clear()
    assert not compat.scheduler_ignores_stale_defer_success()
    monkeypatch.setenv("AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL", "5")
    assert compat.resume_hold() == 7.0


def test_a_fixed_scheduler_drops_the_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the guard of the fix in the scheduler's source, a deferring watcher fires at once."""
    fixed = _scheduler_source().replace(GUARD_3_3, GUARD_FIXED)
    assert compat.requeue_guard_covers_running(fixed)
    monkeypatch.setattr(compat, "scheduler_ignores_stale_defer_success", lambda: True)
    assert compat.resume_hold() == 0.0


def test_a_running_guard_without_next_method_is_not_the_fix() -> None:
    """RUNNING alone in the guard (a requeue by another scheduler, say) is not the fix: the hold stays."""
    source = "def process_executor_events():\n    ti_requeued = ti.state == TaskInstanceState.RUNNING\n"
    assert not compat.requeue_guard_covers_running(source)
    assert not compat.requeue_guard_covers_running("x = 1\n")
