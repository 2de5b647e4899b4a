"""One call for the common case: cluster → job → ranks (mapped) + gang sensor → down (teardown)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import TaskGroup, XComArg

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._args import check_arguments, operator_parameters, parameters
from airflow_provider_sky.operators._spec import SPEC_FIELDS
from airflow_provider_sky.operators.cluster import SkyClusterOperator
from airflow_provider_sky.operators.down import SkyDownOperator
from airflow_provider_sky.operators.job import SkyJobOperator
from airflow_provider_sky.operators.rank import SkyRankOperator
from airflow_provider_sky.sensors.gang import SkyGangSensor
from airflow_provider_sky.watch.jobs import DEFAULT_ORPHAN_TIMEOUT
from airflow_provider_sky.watch.result import DEFAULT_MAX_BYTES, check_result_args
from airflow_provider_sky.watch.retry import RetryPolicy
from airflow_provider_sky.watch.settings import WatchSettings


def check_gang_arguments(where: str, given: Mapping[str, Any], *, without: tuple[str, ...] = ()) -> None:
    """``sky_gang``'s own arguments, the task's fields and ``BaseOperator``'s (handed to the cluster and
    job tasks) are valid; anything else is named here, not by the operator it would have reached."""
    own = [p for p in (*parameters(sky_gang), *SPEC_FIELDS) if p not in without]
    check_arguments(where, given, own, operator_parameters(SkyClusterOperator)[1])


#: task id of the gang sensor in a ``sky_gang`` group: it ends last on success, and pushes the result
GANG_TASK_ID = "gang"


def sky_gang(
    group_id: str = "gang",
    *,
    task_yaml: str | None = None,
    task_config: Mapping[str, Any] | None = None,
    cluster_name: str | None = None,
    sky_conn_id: str | None = SkyHook.default_conn_name,
    poll_interval: float = 0.5,
    grace: float = 3.0,
    lost_after: float = 10.0,
    down: bool = True,
    orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT,
    idle_down: float | None = None,
    triggerers: int = 1,
    hang_timeout: float | None = None,
    retries: int = 0,
    retry_delay: float | Any = 0.0,
    retry_exponential_backoff: bool = False,
    retry_on_exit_codes: Sequence[int] | str | None = None,
    result_ranks: int | str = 0,
    result_max_bytes: int = DEFAULT_MAX_BYTES,
    outlets: Any = None,
    inlets: Any = None,
    **spec_fields: Any,
) -> SkyGangGroup:
    """Build the whole gang pattern in a TaskGroup from a SkyPilot YAML, a dict, or the fields.

    ``spec_fields`` are the YAML's fields as arguments (``num_nodes=4, run="..."``) and override the
    file. ``down=False`` keeps the cluster for the next run (reuse by ``cluster_name``) and takes no
    lease on it, so the next run's teardown removes it. With ``down=True`` runs sharing a
    ``cluster_name`` each hold a lease: the last one's teardown removes the cluster.
    ``orphan_timeout``: the nodes kill a setup or job nothing polled for that many seconds (a lost
    scheduler, a killed ``dags test``); 0 or None turns it off. ``idle_down``: the nodes tear the
    cluster down once nothing has run on it for that many seconds (SkyPilot's autodown, for
    ``down=False``); 0: never; None: with ``down=False`` the YAML's ``resources.autostop`` (a stop there
    is a teardown here, with a warning), else never (with ``down=True`` the run's teardown removes the
    cluster, so autostop changes nothing). ``triggerers``: how many triggerers share the watch; the cluster
    task checks before provisioning that Airflow can map and watch one rank task per node.
    ``hang_timeout``: a running rank silent (no output, no touch of ``$SKY_PROGRESS_FILE``) for that
    many seconds is hung: its stacks are dumped into its log and the gang fails fast; None: off.
    ``retries``: run the whole gang again up to that many times after a retryable failure (a lost node,
    a hang, an exit code in ``retry_on_exit_codes``, or any but 126/127/139 with ``"nonzero"``), every
    process of the failed attempt gone first; ``retry_delay`` seconds (or a timedelta) before each,
    doubled per attempt with ``retry_exponential_backoff``. The rank tasks stay the same through the
    attempts (these are not Airflow's task retries).
    ``.result`` of the group is the gang's result as an XComArg (``evaluate(gang.result)``), pushed once
    every rank succeeded: rank ``result_ranks``' last output line, or the content of ``result_file`` (a
    task field: ``~/out/result.json``, JSON decoded when it parses), a list with ``result_ranks="all"``;
    at most ``result_max_bytes`` bytes. ``outlets``: assets updated only when every rank succeeded (the
    gang sensor emits them, with the run id, nodes, duration and a small result in ``extra``);
    ``inlets`` are shown on the job task.
    """
    result_ranks, result_max_bytes = check_result_args(result_ranks, result_max_bytes)
    check_gang_arguments("sky_gang", spec_fields)
    settings = WatchSettings.build(
        sky_conn_id,
        poll_interval,
        grace,
        lost_after,
        hang_timeout,
        orphan_timeout=orphan_timeout,
        idle_down=idle_down,
        triggerers=triggerers,
    )
    policy = RetryPolicy.build(retries, retry_delay, retry_exponential_backoff, retry_on_exit_codes)
    spec_args: dict[str, Any] = {"task_yaml": task_yaml, "task_config": task_config, **spec_fields}
    #: what the cluster task takes of the watch settings (it polls the setup stage)
    conn: dict[str, Any] = {"sky_conn_id": sky_conn_id, "poll_interval": poll_interval, "grace": grace}
    #: the job task, the rank tasks and the gang sensor watch the gang alike
    watch = dataclasses.replace(settings, retry=policy).operator_kwargs()
    if idle_down is None and down:
        idle_down = 0  # the run's teardown removes the cluster: the YAML's autostop changes nothing
    group = SkyGangGroup(group_id=group_id)
    with group:
        cluster = SkyClusterOperator(
            task_id="cluster",
            cluster_name=cluster_name,
            down_on_failure=down,
            lease=down,  # without a down task nothing would release it
            orphan_timeout=orphan_timeout,
            idle_down=idle_down,
            rank_tasks=True,
            triggerers=triggerers,
            **spec_args,
            **conn,
        )
        job = SkyJobOperator(
            task_id="job",
            cluster=cluster.output,
            orphan_timeout=orphan_timeout,
            idle_down=idle_down,
            **spec_args,
            **watch,
            **({"inlets": inlets} if inlets else {}),
        )
        ranks = SkyRankOperator.partial_in_triggerer(
            task_id="rank",
            cluster=cluster.output,
            cluster_task_id=cluster.task_id,
            job_task_id=job.task_id,
            **watch,
        ).expand_kwargs(job.output)
        gang = SkyGangSensor.in_triggerer(
            task_id=GANG_TASK_ID,
            cluster=cluster.output,
            cluster_task_id=cluster.task_id,
            job_task_id=job.task_id,
            result_file=spec_fields.get("result_file"),
            result_ranks=result_ranks,
            result_max_bytes=result_max_bytes,
            rank_task_id=ranks.task_id,
            **({"outlets": outlets} if outlets else {}),
            **watch,
        )
        job >> [ranks, gang]
        if down:
            teardown = SkyDownOperator(
                task_id="down", cluster_name=cluster_name, sky_conn_id=sky_conn_id, grace=grace
            )
            [ranks, gang] >> teardown.as_teardown(setups=cluster)
    return group


class SkyGangGroup(TaskGroup):
    """The TaskGroup ``sky_gang`` builds, with the gang's result as ``.result``."""

    @property
    def result(self) -> XComArg:
        """The gang sensor's return value: the gang's result, pushed once every rank succeeded."""
        return XComArg(self.sensor)

    @property
    def sensor(self) -> SkyGangSensor:
        """The gang sensor: it ends last when every rank succeeded, and pushes the result."""
        task = self.children[self.child_id(GANG_TASK_ID)]
        assert isinstance(task, SkyGangSensor)
        return task
