"""The watch settings the rank tasks and the gang sensor share, passed on to their triggers as is."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from airflow.triggers.base import BaseTrigger, StartTriggerArgs

from airflow_provider_sky.compat import resume_hold
from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.model.gang import GangStatus
from airflow_provider_sky.spec.timing import LIMITS, check_timing
from airflow_provider_sky.triggers.gang import xcom_ref
from airflow_provider_sky.watch.jobs import run_sync
from airflow_provider_sky.watch.retry import RetryPolicy, operator_args, pop_retry_args
from airflow_provider_sky.watch.settings import WatchFields, WatchSettings


def start_in_triggerer(
    trigger_cls: type[BaseTrigger],
    *,
    cluster_task_id: str,
    job_task_id: str,
    watch: WatchSettings,
    **extra: Any,
) -> StartTriggerArgs:
    """How a watcher task starts (and ends) in the triggerer instead of on a worker.

    A worker per watcher costs seconds of CPU each (a 1,024-rank gang: most of an hour on two cores)
    and a resume hold (``resume_hold``); started from its trigger, a task costs one trigger. The
    triggerer reads the cluster and the job id from the upstream tasks' XComs, once per job
    (``triggers.gang.pulled``); the job task pushes the job id alone under ``sky_job_id`` so no
    trigger pulls the list of every rank.
    """
    return StartTriggerArgs(
        trigger_cls=f"{trigger_cls.__module__}.{trigger_cls.__qualname__}",
        next_method="execute_complete",
        trigger_kwargs={
            "cluster": xcom_ref(cluster_task_id),
            "job_id": xcom_ref(job_task_id, "sky_job_id"),
            **watch.to_kwargs(),
            "end_from_trigger": True,
            **extra,
        },
        next_kwargs=None,
        timeout=None,
    )


def triggerer_watch(
    trigger_cls: type[BaseTrigger],
    operator_kwargs: dict[str, Any],
    *,
    cluster_task_id: str,
    job_task_id: str,
    sky_conn_id: str | None,
    poll_interval: float,
    grace: float,
    lost_after: float,
    hang_timeout: float | None,
    **extra: Any,
) -> tuple[StartTriggerArgs, dict[str, Any]]:
    """What a rank task or gang sensor started in the triggerer needs: its trigger's start arguments and
    the watch settings the task and its trigger share (as the operator's keyword arguments). The
    gang-retry arguments move from ``operator_kwargs`` (changed in place) into the operator's own names
    and the trigger's policy."""
    settings = WatchSettings.build(sky_conn_id, poll_interval, grace, lost_after, hang_timeout)
    policy = pop_retry_args(operator_kwargs)
    operator_kwargs.update(operator_args(policy))
    start = start_in_triggerer(
        trigger_cls,
        cluster_task_id=cluster_task_id,
        job_task_id=job_task_id,
        watch=dataclasses.replace(settings, retry=policy),
        **extra,
    )
    return start, {
        "sky_conn_id": sky_conn_id,
        "poll_interval": poll_interval,
        "grace": grace,
        "hang_timeout": settings.hang_timeout,
    }


class GangWatchMixin(WatchFields):
    """Holds how a task watches a job (:class:`WatchSettings`: connection, poll interval, cancel grace,
    lost-node and hang timeouts, gang retries).

    Every watcher of one job must use the same settings: the triggers share one poll per job and
    interval, so one rank task polling at another rate would start a second poll of every node.
    """

    cluster: Any

    def _init_watch(
        self,
        cluster: Any,
        sky_conn_id: str | None,
        poll_interval: float,
        grace: float,
        lost_after: float,
        hang_timeout: float | None = None,
        policy: RetryPolicy | None = None,
    ) -> None:
        self.watch = WatchSettings.build(sky_conn_id, poll_interval, grace, lost_after, hang_timeout, policy)
        self.cluster = cluster

    def _peek(self, job_id: Any, ranks: Sequence[int] | None = None) -> GangStatus:
        """The job's state now (every rank, or only ``ranks``; no mark left on the nodes)."""
        client = SkyHook(self.sky_conn_id).client(self.cluster)
        try:
            return client.peek(str(job_id), ranks)
        finally:
            client.close()

    def _first_event(self, trigger: BaseTrigger) -> dict[str, Any]:
        """Run ``trigger`` here until its event: for a job already over, no deferral is needed."""

        async def first() -> dict[str, Any]:
            async for event in trigger.run():
                return dict(event.payload)
            raise RuntimeError(f"{type(trigger).__name__} ended without an event")

        return run_sync(first())

    def _watch_kwargs(self, job_id: Any, *, deferring: bool = True) -> dict[str, Any]:
        """The trigger keyword arguments common to SkyRankTrigger and SkyGangTrigger."""
        return {
            "fire_after": time.time() + resume_hold() if deferring else None,
            "cluster": self.cluster,
            "job_id": str(job_id),
            **self.watch.to_kwargs(),
        }


def check_watch_kwargs(kwargs: dict[str, Any]) -> None:
    """The timing arguments among an operator's keyword arguments (``partial()``'s), checked now."""
    check_timing(**{k: v for k, v in kwargs.items() if k in LIMITS and k != "triggerers"})
