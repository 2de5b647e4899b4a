"""Workarounds for bugs of Airflow core, each with the Airflow versions it applies to.

Every workaround here finds out whether the installed Airflow still needs it, and does nothing where it
does not, so upgrading Airflow retires it without a change here; remove one once the oldest supported
Airflow (``apache-airflow>=3.3`` in pyproject.toml) carries the fix.

- ``resume_hold``: Airflow 3.3.0-3.3.2 (and later 3.3 releases until one carries apache/airflow#72767) can
  fail a deferred task whose trigger fires right after the deferral ("state mismatch",
  apache/airflow#72716, #71580). Read from the scheduler's source, not its version.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

from airflow.configuration import conf


def resume_hold() -> float:
    """Seconds a deferred watcher's event waits after the deferral (Airflow 3.3 core race workaround).

    When a task defers, its worker exits and the executor reports "success" for that try; the task
    supervisor notices the exit up to ``[workers] min_heartbeat_interval`` later. If the trigger fires
    before the scheduler processed that stale report and the task is already queued or running again,
    Airflow 3.3 marks it failed ("state mismatch", apache/airflow#72716, #71580). Holding the event
    past that window lets the report land while the task is still deferred, where it is ignored.
    Nothing outside the scheduler can tell when that report was processed (the scheduler writes
    nothing for a deferred task's stale report), hence a fixed hold. No hold where it cannot matter:
    under ``dag.test()`` (task and trigger in one process, no executor) and with a scheduler that
    ignores the stale report (``scheduler_ignores_stale_defer_success``).
    """
    from airflow.sdk.execution_time import task_runner

    if type(getattr(task_runner, "SUPERVISOR_COMMS", None)).__name__ == "InProcessSupervisorComms":
        return 0.0
    if scheduler_ignores_stale_defer_success():
        return 0.0
    return float(conf.getint("workers", "min_heartbeat_interval", fallback=5)) + 2.0


@functools.cache
def scheduler_ignores_stale_defer_success() -> bool:
    """Whether the installed Airflow's scheduler carries the fix of apache/airflow#72716 (PR #72767).

    Read from the scheduler's code, not its version: no release carries the fix yet (3.3.2 does not).
    The fix makes ``process_executor_events`` count a same-try success for a RUNNING task with
    ``next_method`` set as a requeue (``ti_requeued``); 3.3's guard names only SCHEDULED (and QUEUED
    on main). The source is parsed, not imported (a worker need not load the scheduler), and anything
    unexpected answers False: the hold stays.
    """
    try:
        spec = importlib.util.find_spec("airflow.jobs.scheduler_job_runner")
        if spec is None or spec.origin is None:
            return False
        return requeue_guard_covers_running(Path(spec.origin).read_text())
    except Exception:  # an unreadable or reshaped scheduler: keep the hold
        return False


def requeue_guard_covers_running(source: str) -> bool:
    """True when ``process_executor_events`` in ``source`` treats a RUNNING task with ``next_method``
    as requeued (the #72716 fix), i.e. the ``ti_requeued`` expression names both."""
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.FunctionDef) and node.name == "process_executor_events"):
            continue
        for sub in ast.walk(node):
            targets = sub.targets if isinstance(sub, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "ti_requeued" for t in targets):
                assert isinstance(sub, ast.Assign)
                names = {n.attr for n in ast.walk(sub.value) if isinstance(n, ast.Attribute)}
                return "RUNNING" in names and "next_method" in names
    return False
