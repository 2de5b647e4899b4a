"""The gang sensor: fails within about a second of the first nonzero exit, so the DAG run fails."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._watch import GangWatchMixin
from airflow_provider_sky.triggers.gang import SkyGangTrigger


class SkyGangSensor(GangWatchMixin, BaseSensorOperator):
    """Watch every rank of a job at once (deferred); succeed when all succeed, fail on the first failure.

    :param ranks: the job task's output (one entry per rank, each with the ``job_id``).
    """

    template_fields: Sequence[str] = ("cluster", "ranks")
    ui_color = "#fce4ec"

    def __init__(
        self,
        *,
        cluster: Any,
        ranks: Any,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        poll_interval: float = 0.5,
        grace: float = 3.0,
        lost_after: float = 10.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retries", 0)
        super().__init__(**kwargs)
        self._init_watch(cluster, sky_conn_id, poll_interval, grace, lost_after)
        self.ranks = ranks

    def _trigger(self, *, deferring: bool = True) -> SkyGangTrigger:
        return SkyGangTrigger(**self._watch_kwargs(self.ranks[0]["job_id"], deferring=deferring))

    def execute(self, context: Any) -> None:
        if self._already_over():
            # e.g. a rank failed at once and the job task's watcher cancelled the gang: no deferral,
            # so no triggerer round trip and no resume hold before the run can fail
            self.log.info("Job %s has already ended; reading its outcome now", self.ranks[0]["job_id"])
            return self.execute_complete(context, self._first_event(self._trigger(deferring=False)))
        self.defer(trigger=self._trigger(), method_name="execute_complete")

    def _already_over(self) -> bool:
        return self._peek(self.ranks[0]["job_id"]).done

    def poke(self, context: Any) -> bool:  # only used if deferrable=False
        client = SkyHook(self.sky_conn_id).client(self.cluster)
        try:
            status = client.poll(self.ranks[0]["job_id"], max_log=0).status
        finally:
            client.close()
        if status.failed:
            client.cancel(status.job_id, grace=self.grace)
            raise AirflowFailException(status.failure_message())
        return status.succeeded

    def execute_complete(self, context: Any, event: dict[str, Any]) -> None:
        gang = event.get("gang") or {}
        for r in gang.get("ranks", []):
            self.log.info(
                "rank %s (%s): %s, exit code %s, %s",
                r["rank"],
                r["ip"],
                r["state"],
                r["exit_code"],
                r["reason"],
            )
        if event["state"] != "succeeded":
            raise AirflowFailException(event["message"])
        self.log.info("%s", event["message"])
