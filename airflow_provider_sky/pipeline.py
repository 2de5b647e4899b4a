"""A SkyPilot pipeline file (several tasks, ``---`` between them) as gangs run one after another."""

from __future__ import annotations

import os
import re
from typing import Any

from airflow.sdk import TaskGroup

from airflow_provider_sky.operators._spec import default_cluster_name
from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.spec.yamlfile import load_pipeline_yaml
from airflow_provider_sky.taskgroup import SkyGangGroup, check_gang_arguments, sky_gang

_GROUP_ID = re.compile(r"[^A-Za-z0-9_.-]")


def sky_pipeline(
    task_yaml: str | os.PathLike[str], group_id: str | None = None, **gang_args: Any
) -> TaskGroup:
    """One :func:`sky_gang` per task of a SkyPilot pipeline file, in one TaskGroup: each gang starts once
    the one before it succeeded (its gang sensor), so a failed task stops the pipeline there, as
    ``sky jobs launch`` of a pipeline does. ``group_id``: the pipeline's ``name:`` (else ``pipeline``);
    each gang's group is its task's ``name`` (else ``task<i>``). ``gang_args`` go to every
    :func:`sky_gang` (``sky_conn_id``, ``retries``, ``down`` ...). Each task has its own cluster, named
    after the DAG and the task's group (not the run): runs of the DAG at the same time share it, each
    with its lease, as gangs given one ``cluster_name`` do."""
    if "task_config" in gang_args or "cluster_name" in gang_args:
        raise SpecError(
            "sky_pipeline",
            "takes the tasks from the file: give no task_config, and no cluster_name (each task gets its own "
            "cluster, named after the pipeline's group and the task)",
        )
    check_gang_arguments("sky_pipeline", gang_args)
    name, tasks = load_pipeline_yaml(task_yaml)
    outer = TaskGroup(group_id=group_id or _GROUP_ID.sub("-", name or "pipeline"))
    dag = outer.dag
    if dag is None:
        raise SpecError("sky_pipeline", "call it inside a DAG (with DAG(...): sky_pipeline(...))")
    previous: SkyGangGroup | None = None
    seen: set[str] = set()
    with outer:
        for i, task in enumerate(tasks):
            gid = _GROUP_ID.sub("-", str(task.get("name") or f"task{i + 1}"))
            if gid in seen:
                gid = f"{gid}-{i + 1}"
            seen.add(gid)
            # a cluster per task: the DAG's default name is one per run, which every gang would share;
            # runs of the DAG at once share a task's cluster, each with its lease (sky_gang's cluster_name)
            cluster = default_cluster_name(dag.dag_id, f"sky_pipeline:{outer.group_id}.{gid}")
            gang = sky_gang(group_id=gid, task_config=task, cluster_name=cluster, **gang_args)
            if previous is not None:
                previous.sensor >> gang  # after the previous gang succeeded (not merely after its teardown)
            previous = gang
    return outer
