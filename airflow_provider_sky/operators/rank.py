"""One Airflow task per rank: deferrable, shows the rank's live log, ends with its exit code and reason."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._watch import GangWatchMixin
from airflow_provider_sky.triggers.gang import SkyRankTrigger

RANK_LABEL = "rank {{ task.rank }}"


class SkyRankOperator(GangWatchMixin, BaseOperator):
    """Attach to one rank of a started job (it never launches anything) and wait for it deferred.

    Map it over the job task's output: ``SkyRankOperator.partial(cluster=...).expand_kwargs(job.output)``.
    Airflow retries are off: a rank retried alone would join a gang whose siblings are gone. Retry the
    gang instead (clear the cluster, job and rank tasks together).
    """

    template_fields: Sequence[str] = ("cluster", "rank", "job_id")
    ui_color = "#e8f5e9"

    @classmethod
    def partial(cls, **kwargs: Any) -> Any:
        """Label mapped ranks ``rank N`` in the UI: Airflow reads the label from ``partial()``."""
        kwargs.setdefault("map_index_template", RANK_LABEL)
        return super().partial(**kwargs)

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
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("map_index_template", RANK_LABEL)
        if kwargs.get("retries"):
            raise ValueError(
                "retries: rank tasks run without Airflow retries, because a rank retried alone would join a "
                "gang whose siblings are gone; retry the whole gang (clear the cluster, job and rank tasks)"
            )
        kwargs["retries"] = 0
        super().__init__(**kwargs)
        self._init_watch(cluster, sky_conn_id, poll_interval, grace, lost_after)
        self.rank = rank
        self.job_id = job_id
        self.ip = ip

    def _trigger(self, *, deferring: bool = True) -> SkyRankTrigger:
        return SkyRankTrigger(rank=int(self.rank), **self._watch_kwargs(self.job_id, deferring=deferring))

    def execute(self, context: Any) -> dict[str, Any] | None:
        self.log.info("Attaching to rank %s of job %s (%s)", self.rank, self.job_id, self.ip)
        if self._already_over():
            # A rank that ended before its task started needs no deferral (nor the triggerer round trip).
            self.log.info("Rank %s has already ended; reading its outcome now", self.rank)
            return self.execute_complete(context, self._first_event(self._trigger(deferring=False)))
        self.defer(trigger=self._trigger(), method_name="execute_complete")
        return None

    def _already_over(self) -> bool:
        try:
            return self._peek(self.job_id).by_rank(int(self.rank)).terminal
        except KeyError:
            return False

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        duration = event.get("duration")
        self.log.info(
            "rank %s (%s): %s, exit code %s, %s%s",
            event["rank"],
            event["ip"],
            event["state"],
            event["exit_code"],
            event["reason"],
            f", {duration:.1f}s" if duration else "",
        )
        summary = {k: event.get(k) for k in ("rank", "ip", "state", "exit_code", "reason", "start", "end")}
        # pushed before failing too, so a failed rank's outcome can be read back from Airflow
        context["ti"].xcom_push(key="sky_rank", value=summary)
        if event["state"] != "succeeded":
            raise AirflowFailException(event["message"])
        return summary
