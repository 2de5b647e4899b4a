"""What Airflow says of a gang's rank tasks, read from a trigger (the triggerer's supervisor asks the API).

A user's mark-failed or mark-success of a deferred rank task reaches the gang through that task's trigger
(``on_kill``). When no triggerer runs the trigger at that moment (every triggerer restarting), Airflow
drops the trigger with the task's new state and nothing is told: the gang trigger, which lives on, looks
at its rank tasks' states every :data:`LOOK_EVERY` seconds and finds the rank task that no longer watches
a rank still running.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

#: seconds between two looks at the rank tasks' states (one API call for every rank)
LOOK_EVERY = 5.0
#: the states a user's mark-failed or mark-success leaves on a rank task. A clear is not here: the task
#: runs again and re-attaches to its running rank.
ACTED = frozenset({"failed", "success", "skipped", "removed", "upstream_failed"})


async def acted_on(ti: Any, rank_task_id: str, running: Iterable[int]) -> dict[int, str] | None:
    """The ranks of ``running`` whose rank task (``rank_task_id``, map index = rank, in ``ti``'s run)
    is in a state of :data:`ACTED`, with that state; None when Airflow could not be asked (no
    supervisor: ``dag.test()``; the API failed)."""
    try:
        from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
        from asgiref.sync import sync_to_async

        states = await sync_to_async(RuntimeTaskInstance.get_task_states)(
            dag_id=ti.dag_id, task_ids=[rank_task_id], run_ids=[ti.run_id]
        )
    except Exception as exc:  # no supervisor to ask, or the API failed: the next look
        log.debug("Could not read the states of %s: %s", rank_task_id, exc)
        return None
    by_key = states.get(ti.run_id) or {}
    out = {}
    for rank in running:
        state = by_key.get(f"{rank_task_id}_{rank}")
        if state is not None and str(state) in ACTED:  # TaskInstanceState is a str enum
            out[rank] = str(state)
    return out


def acted_reason(ti: Any, rank_task_id: str, acted: dict[int, str]) -> str:
    """The cancel reason every rank shows: which rank task a user acted on, and that its trigger did not act."""
    ranks = sorted(acted)
    which = ", ".join(f"[rank {r}] ({acted[r]})" for r in ranks)
    return (
        f"rank task {rank_task_id} {which} of DAG {ti.dag_id}, run {ti.run_id}, was marked failed or "
        "marked success by a user, and its own trigger did not stop the gang"
    )
