"""Airflow cluster policy (entry point ``airflow.policy``): rank tasks are labelled ``rank N`` in the UI.

A mapped task's UI label is its ``map_index_template`` rendered by the worker that runs it. Rank tasks
started in the triggerer never run on a worker, and Airflow 3.3's triggerer has no way to set the label
(its execution API token is not the task's own, trigger code has no database access, and an event
cannot carry it). The scheduler, though, applies ``task_instance_mutation_hook`` to every task
instance it creates or refreshes, with the task at hand: for a rank task (``map_index_template`` is
:data:`RANK_LABEL`) the rank is the map index (the job task returns one entry per rank, in rank
order), so the label is known there, before the task even starts. Any other task is left alone.
"""

from __future__ import annotations

from typing import Any

from airflow.policies import hookimpl

#: the label of a mapped rank task; ``task.rank`` is its map index (see the module docstring)
RANK_LABEL = "rank {{ task.rank }}"


@hookimpl
def task_instance_mutation_hook(task_instance: Any, dag_run: Any) -> None:
    """Give a rank task instance its ``rank N`` label when nothing has rendered one yet."""
    map_index = getattr(task_instance, "map_index", -1)
    if map_index is None or map_index < 0 or getattr(task_instance, "_rendered_map_index", None):
        return
    task = getattr(task_instance, "task", None)
    if task is None or getattr(task, "map_index_template", None) != RANK_LABEL:
        return
    task_instance._rendered_map_index = f"rank {map_index}"
