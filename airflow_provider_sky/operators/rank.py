"""One Airflow task per rank: deferrable, shows the rank's live log, ends with its exit code and reason."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException
from airflow.triggers.base import StartTriggerArgs

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._args import check_operator_arguments
from airflow_provider_sky.operators._watch import GangWatchMixin, check_watch_kwargs, triggerer_watch
from airflow_provider_sky.policy import RANK_LABEL
from airflow_provider_sky.triggers.gang import MAP_INDEX, SkyRankTrigger
from airflow_provider_sky.triggers.outcome import rank_end_lines, rank_summary
from airflow_provider_sky.watch.retry import operator_policy

_NO_RETRIES = (
    "retries: rank tasks run without Airflow retries, because a rank retried alone would join a "
    "gang whose siblings are gone; retry the whole gang (clear the cluster, job and rank tasks)"
)


class SkyRankOperator(GangWatchMixin, BaseOperator):
    """Attach to one rank of a started job (it never launches anything) and wait for it deferred.

    Map it over the job task's output: ``SkyRankOperator.partial(cluster=...).expand_kwargs(job.output)``.
    Airflow retries are off: a rank retried alone would join a gang whose siblings are gone. Retry the
    gang instead (clear the cluster, job and rank tasks together).
    """

    template_fields: Sequence[str] = ("cluster", "rank", "job_id")
    ui_color = "#e8f5e9"
    start_trigger_args = StartTriggerArgs(
        trigger_cls=f"{SkyRankTrigger.__module__}.{SkyRankTrigger.__qualname__}",
        next_method="execute_complete",
        trigger_kwargs=None,
        next_kwargs=None,
        timeout=None,
    )
    start_from_trigger = False

    @classmethod
    def partial(cls, **kwargs: Any) -> Any:
        """Label mapped ranks ``rank N`` in the UI (Airflow reads the label from ``partial()``); no retries."""
        kwargs.setdefault("map_index_template", RANK_LABEL)
        if kwargs.get("retries"):
            raise ValueError(_NO_RETRIES)
        kwargs["retries"] = 0  # also over default_args: a failed rank must not come back on its own
        check_operator_arguments(cls, kwargs, task_id=kwargs.get("task_id"))  # __init__ runs only at run time
        check_watch_kwargs(kwargs)  # a mapped task's __init__ runs only when it runs: check now
        return super().partial(**kwargs)

    @classmethod
    def partial_in_triggerer(
        cls,
        *,
        cluster_task_id: str,
        job_task_id: str,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        poll_interval: float = 0.5,
        grace: float = 3.0,
        lost_after: float = 10.0,
        hang_timeout: float | None = None,
        **kwargs: Any,
    ) -> Any:
        """``partial()`` of rank tasks that start and end in the triggerer, never on a worker.

        The rank comes from the map index (the job task returns one entry per rank, in rank order).
        Under ``dag.test()`` the tasks run ``execute`` as usual.
        """
        start, watch = triggerer_watch(
            SkyRankTrigger,
            kwargs,
            cluster_task_id=cluster_task_id,
            job_task_id=job_task_id,
            sky_conn_id=sky_conn_id,
            poll_interval=poll_interval,
            grace=grace,
            lost_after=lost_after,
            hang_timeout=hang_timeout,
            rank=MAP_INDEX,
        )
        return cls.partial(
            start_from_trigger=True, start_trigger_args=start, lost_after=lost_after, **watch, **kwargs
        )

    def __init__(
        self,
        *,
        cluster: Any,
        rank: Any,
        job_id: Any,
        ip: Any = None,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        poll_interval: float = 0.5,
        grace: float = 3.0,
        lost_after: float = 10.0,
        hang_timeout: float | None = None,
        gang_retries: int = 0,
        gang_retry_delay: Any = 0.0,
        gang_retry_exponential_backoff: bool = False,
        retry_on_exit_codes: Any = None,
        start_from_trigger: bool = False,
        start_trigger_args: StartTriggerArgs | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("map_index_template", RANK_LABEL)
        if kwargs.get("retries"):
            raise ValueError(_NO_RETRIES)
        kwargs["retries"] = 0
        policy = operator_policy(
            gang_retries, gang_retry_delay, gang_retry_exponential_backoff, retry_on_exit_codes
        )
        check_operator_arguments(self, kwargs, task_id=kwargs.get("task_id"))
        super().__init__(**kwargs)
        self._init_watch(cluster, sky_conn_id, poll_interval, grace, lost_after, hang_timeout, policy)
        self.rank = rank
        self.job_id = job_id
        self.ip = ip
        self.start_from_trigger = start_from_trigger
        if start_trigger_args is not None:
            self.start_trigger_args = start_trigger_args

    def _trigger(self, *, deferring: bool = True) -> SkyRankTrigger:
        return SkyRankTrigger(rank=int(self.rank), **self._watch_kwargs(self.job_id, deferring=deferring))

    def execute(self, context: Context) -> dict[str, Any] | None:
        self.log.info("Attaching to rank %s of job %s (%s)", self.rank, self.job_id, self.ip)
        if self._already_over():
            # A rank that ended before its task started needs no deferral (nor the triggerer round trip).
            self.log.info("Rank %s has already ended; reading its outcome now", self.rank)
            return self.execute_complete(context, self._first_event(self._trigger(deferring=False)))
        self.defer(trigger=self._trigger(), method_name="execute_complete")
        return None

    def _already_over(self) -> bool:
        """One look at this rank alone: N rank tasks starting together must not ask N nodes each."""
        try:
            return self._peek(self.job_id, [int(self.rank)]).by_rank(int(self.rank)).terminal
        except KeyError:
            return False

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        # the short root cause first, then the outcome (what the triggerer logs when it ends the task)
        for level, line in rank_end_lines({**event, "message": ""}):
            getattr(self.log, level)("%s", line)
        summary = rank_summary(event)
        # pushed before failing too, so a failed rank's outcome can be read back from Airflow
        context["ti"].xcom_push(key="sky_rank", value=summary)
        if event["state"] != "succeeded":
            raise AirflowFailException(event["message"])
        return summary
