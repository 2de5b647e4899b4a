"""SkyPilot's multi-document files: a pipeline (tasks one after another) and a job group (tasks started
together, failing together), each as gangs in one TaskGroup."""

from __future__ import annotations

import os
import re
from typing import Any

from airflow.sdk import TaskGroup

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._spec import default_cluster_name
from airflow_provider_sky.operators.jobgroup import (
    STOP_ENV,
    SkyJobGroupEndOperator,
    SkyJobGroupStopOperator,
    auxiliary_run,
    stop_path,
)
from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.spec.yamlfile import load_job_group_yaml, load_pipeline_yaml
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
    _check_args("sky_pipeline", gang_args)
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


def _check_args(where: str, gang_args: dict[str, Any]) -> None:
    if "task_config" in gang_args or "cluster_name" in gang_args:
        raise SpecError(
            where,
            "takes the tasks from the file: give no task_config, and no cluster_name (each task gets its own "
            "cluster, named after the group and the task)",
        )
    check_gang_arguments(where, gang_args)


#: set in every task of a job group to the group's name, as SkyPilot does
JOBGROUP_ENV = "SKYPILOT_JOBGROUP_NAME"


def sky_job_group(
    task_yaml: str | os.PathLike[str], group_id: str | None = None, **gang_args: Any
) -> TaskGroup:
    """One :func:`sky_gang` per task of a SkyPilot job group file (header ``execution: parallel``), in
    one TaskGroup, as ``sky jobs launch`` of a job group runs them: started together (every task's job
    starts once every task's cluster is up and set up) and failing together (when one gang fails, the
    other gangs' jobs are cancelled and the group fails). Each task gets ``SKYPILOT_JOBGROUP_NAME``.
    ``group_id``: the group's ``name`` by default; each gang's group is its task's name. ``gang_args``
    go to every :func:`sky_gang`. SkyPilot's hostnames for the tasks (``trainer-0.<group>``, Kubernetes
    only there) are not set up here: tasks reach each other by address (a port on an SSH host, a
    Service on Kubernetes). With ``primary_tasks``, an ``end_auxiliaries`` task tells the other (auxiliary)
    tasks to end once every primary gang succeeded; each ends as succeeded after its
    ``termination_delay``."""
    _check_args("sky_job_group", gang_args)
    group = load_job_group_yaml(task_yaml)
    name, tasks = group.name, group.tasks
    outer = TaskGroup(group_id=group_id or _GROUP_ID.sub("-", name))
    dag = outer.dag
    if dag is None:
        raise SpecError("sky_job_group", "call it inside a DAG (with DAG(...): sky_job_group(...))")
    gangs: list[SkyGangGroup] = []
    with outer:
        for task in tasks:
            gid = _GROUP_ID.sub("-", str(task["name"]))
            given = task.get("envs")
            envs: dict[str, Any] = {**(given if isinstance(given, dict) else {}), JOBGROUP_ENV: name}
            if task["name"] not in group.primary:  # an auxiliary task: ended once the primary ones are done
                envs[STOP_ENV] = stop_path(name, "{{ run_id }}")  # rendered per run
                task = {**task, "run": auxiliary_run(str(task.get("run") or ""))}
            task = {**task, "envs": envs}
            cluster = default_cluster_name(dag.dag_id, f"sky_job_group:{outer.group_id}.{gid}")
            gangs.append(sky_gang(group_id=gid, task_config=task, cluster_name=cluster, **gang_args))
        parts: list[tuple[str, Any, Any, Any]] = [
            (
                gid,
                g.get_child_by_label("cluster"),
                g.get_child_by_label("job"),
                g.get_child_by_label("gang"),
            )
            for g, gid in zip(gangs, (str(t["name"]) for t in tasks), strict=True)
        ]
        for _, _, job, _ in parts:  # started together: no job before every cluster is up
            for _, first, _, _ in parts:
                if first.task_id not in job.upstream_task_ids:
                    first >> job
        stop = SkyJobGroupStopOperator(
            task_id="stop_together",
            group_name=name,
            gangs=[(label, c.task_id, j.task_id) for label, c, j, _ in parts],
            sky_conn_id=gang_args.get("sky_conn_id", SkyHook.default_conn_name),
            grace=gang_args.get("grace", 3.0),
        )
        for _, _, _, sensor in parts:
            sensor >> stop
        if group.delays:  # auxiliary tasks: told to end once every primary gang succeeded
            end = SkyJobGroupEndOperator(
                task_id="end_auxiliaries",
                group_name=name,
                gangs=[
                    (label, c.task_id, group.delays[label])
                    for label, c, _, _ in parts
                    if label in group.delays
                ],
                sky_conn_id=gang_args.get("sky_conn_id", SkyHook.default_conn_name),
            )
            for label, _, _, sensor in parts:
                if label not in group.delays:
                    sensor >> end
    return outer
