"""The cause of a failed gang in the notes of its DAG run and of its rank task instances.

In the run's rank list every rank reads ``failed``: which one failed first, and why, was a click into a log
away. Airflow 3.3 gives tasks and triggers no way to write a note (the execution API has none, and trigger
code has no database access); the scheduler, which marks the run failed, has both. So this is a DAG run
listener (registered by :mod:`airflow_provider_sky.plugin`): when a run fails it reads the rank tasks'
``sky_rank`` XComs, and writes

* on the run: per gang, the rank that failed first, its exit reason and its last lines of output;
* on that rank's task instance: the same;
* on each cancelled rank's task instance: that it was cancelled, and which rank failed first, and why.

A note a user wrote is never replaced. The output lines are the ones the rank's node wrote in its log,
with the job's secrets masked there. Nothing here may break the scheduler: it reads two indexed tables,
writes only notes, and any error is logged and dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from airflow.listeners import hookimpl

log = logging.getLogger(__name__)

#: the XCom every rank task pushes with its outcome (see ``triggers.outcome.rank_summary``)
RANK_XCOM = "sky_rank"
#: Airflow's note column holds at most 1,000 characters
NOTE_CHARS = 1000
_BAD = ("failed", "lost")


def root_cause(ranks: Iterable[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The first failing rank by time (ties go to the lower rank), as the gang itself decides it."""
    bad = [r for r in ranks if r.get("state") in _BAD]
    if not bad:
        return None
    return min(bad, key=lambda r: (r.get("end") if r.get("end") is not None else float("inf"), r["rank"]))


def cause_words(cause: Mapping[str, Any]) -> str:
    """``rank 2 (10.0.0.3) exited with code 3`` (and its decoded reason, when it says more)."""
    who = f"rank {cause['rank']} ({cause.get('ip')})"
    reason = str(cause.get("reason") or "")
    if cause.get("state") == "lost":
        return f"{who} was lost: {reason}"
    code = cause.get("exit_code")
    said = f"{who} exited with code {code}"
    return said + (f": {reason}" if reason and reason != f"exited with code {code}" else "")


def gang_notes(ranks: Sequence[Mapping[str, Any]]) -> tuple[str, dict[int, str]] | None:
    """(the run's note for this gang, {rank: its task instance's note}); None when no rank failed."""
    cause = root_cause(ranks)
    if cause is None:
        return None
    first = f"{cause_words(cause)}, failed first"
    output = [str(line) for line in cause.get("last_output") or ()]
    said = f"{first}. Its last output:\n" + "\n".join(output) if output else first
    notes = {int(cause["rank"]): said[:NOTE_CHARS]}
    for r in ranks:
        if r["rank"] != cause["rank"] and r.get("state") == "cancelled":
            notes[int(r["rank"])] = f"cancelled: {first}"[:NOTE_CHARS]
    return said, notes


def _summaries(session: Any, dag_run: Any) -> dict[str, list[dict[str, Any]]]:
    """Each rank task's ``sky_rank`` outcome in this run, by task id (a DAG may hold several gangs)."""
    from airflow.models.xcom import XComModel
    from sqlalchemy import select

    rows = session.scalars(
        select(XComModel).where(
            XComModel.dag_id == dag_run.dag_id,
            XComModel.run_id == dag_run.run_id,
            XComModel.key == RANK_XCOM,
            XComModel.map_index >= 0,
        )
    )
    out: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        value = XComModel.deserialize_value(row)
        if isinstance(value, dict) and "rank" in value and "state" in value:
            out.setdefault(row.task_id, []).append({**value, "_map_index": row.map_index})
    return out


def write_notes(session: Any, dag_run: Any) -> None:
    """The notes of a failed run (see the module docstring), in ``session`` (the caller commits)."""
    from airflow.models.taskinstance import TaskInstance
    from sqlalchemy import select

    gangs = _summaries(session, dag_run)
    run_lines = []
    for task_id, ranks in sorted(gangs.items()):
        found = gang_notes(ranks)
        if found is None:
            continue
        said, notes = found
        group = task_id.rsplit(".", 1)[0] if "." in task_id else ""
        run_lines.append(f"{group}: {said}" if group and len(gangs) > 1 else said)
        by_rank = {int(r["rank"]): r["_map_index"] for r in ranks}
        tis = session.scalars(
            select(TaskInstance).where(
                TaskInstance.dag_id == dag_run.dag_id,
                TaskInstance.run_id == dag_run.run_id,
                TaskInstance.task_id == task_id,
                TaskInstance.map_index.in_([by_rank[r] for r in notes]),
            )
        )
        rank_of = {m: r for r, m in by_rank.items()}
        for ti in tis:
            if not ti.note:
                ti.note = notes[rank_of[ti.map_index]]
    if run_lines and not dag_run.note:
        dag_run.note = "\n".join(run_lines)[:NOTE_CHARS]


@hookimpl
def on_dag_run_failed(dag_run: Any, msg: str) -> None:
    """Airflow's listener hook: runs in the scheduler, in its session (the run row is locked there: a
    second session writing notes would wait on it), and in ``dag.test()``."""
    from sqlalchemy.orm import object_session

    try:
        session = object_session(dag_run)
        if session is not None:
            # no savepoint: the scheduler forbids any commit inside its loop, a savepoint's release included
            # (it guards its HA locks); the notes are two plain inserts it commits with the run's state
            write_notes(session, dag_run)
            return
        # dag.test(): an inner session's close detached the run object; no one holds its row
        from airflow.models.dagrun import DagRun
        from airflow.utils.session import create_session

        with create_session() as own:
            run = own.get(DagRun, dag_run.id)
            if run is not None:
                write_notes(own, run)
    except Exception:
        log.warning("Could not write the failure notes of %s", dag_run, exc_info=True)
