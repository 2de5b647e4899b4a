"""The gang sensor: fails within about a second of the first nonzero exit, so the DAG run fails."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import Asset, BaseSensorOperator, Context
from airflow.sdk.exceptions import AirflowFailException
from airflow.triggers.base import StartTriggerArgs

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._args import check_operator_arguments
from airflow_provider_sky.operators._watch import GangWatchMixin, triggerer_watch
from airflow_provider_sky.triggers.gang import SkyGangTrigger
from airflow_provider_sky.triggers.outcome import gang_outcome
from airflow_provider_sky.watch.result import DEFAULT_MAX_BYTES, check_result_args, result_config, small
from airflow_provider_sky.watch.retry import operator_policy


class SkyGangSensor(GangWatchMixin, BaseSensorOperator):
    """Watch every rank of a job at once (deferred); succeed when all succeed, fail on the first failure.

    :param ranks: the job task's output (one entry per rank, each with the ``job_id``).
    :param job_id: rendered in the triggerer when the sensor starts there (see :meth:`in_triggerer`).
    :param result_file, result_ranks, result_max_bytes: the gang's result, this task's return value
        once every rank succeeded (see :mod:`airflow_provider_sky.watch.result`): rank ``result_ranks``' last
        output line, or its ``result_file`` (give the job task the same ``result_file``), or with
        ``"all"`` a list, one per rank; at most ``result_max_bytes`` bytes. ``do_xcom_push=False``: none.
    :param outlets: assets this task updates once every rank succeeded, with the run id, the nodes, the
        duration and a small result in each event's ``extra``; a failed gang emits none.
    :param rank_task_id: the mapped task watching each rank (``sky_gang`` passes its own): a user's
        mark-failed or mark-success of one of them while no triggerer runs its trigger still stops the gang.
    """

    template_fields: Sequence[str] = ("cluster", "ranks", "job_id")
    ui_color = "#fce4ec"

    def __init__(
        self,
        *,
        cluster: Any,
        ranks: Any = None,
        job_id: Any = None,
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
        result_file: str | None = None,
        result_ranks: int | str = 0,
        result_max_bytes: int = DEFAULT_MAX_BYTES,
        rank_task_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("retries", 0)
        result_ranks, result_max_bytes = check_result_args(result_ranks, result_max_bytes)
        policy = operator_policy(
            gang_retries, gang_retry_delay, gang_retry_exponential_backoff, retry_on_exit_codes
        )
        check_operator_arguments(self, kwargs, task_id=kwargs.get("task_id"))
        super().__init__(**kwargs)
        self._init_watch(cluster, sky_conn_id, poll_interval, grace, lost_after, hang_timeout, policy)
        self.ranks = ranks
        self.job_id = job_id
        self.result_file = result_file
        self.result_ranks = result_ranks
        self.result_max_bytes = result_max_bytes
        self.rank_task_id = rank_task_id
        self.start_from_trigger = start_from_trigger
        if start_trigger_args is not None:
            self.start_trigger_args = start_trigger_args

    @classmethod
    def in_triggerer(
        cls,
        *,
        cluster: Any,
        cluster_task_id: str,
        job_task_id: str,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        poll_interval: float = 0.5,
        grace: float = 3.0,
        lost_after: float = 10.0,
        hang_timeout: float | None = None,
        result_file: str | None = None,
        result_ranks: int | str = 0,
        result_max_bytes: int = DEFAULT_MAX_BYTES,
        rank_task_id: str | None = None,
        **kwargs: Any,
    ) -> SkyGangSensor:
        """A gang sensor that starts and ends in the triggerer (no worker, no resume hold): the run
        can fail as soon as the triggerer has seen the failure. Under ``dag.test()`` it runs
        ``execute`` as usual, reading the job id from the job task's XCom."""
        start, watch = triggerer_watch(
            SkyGangTrigger,
            kwargs,
            cluster_task_id=cluster_task_id,
            job_task_id=job_task_id,
            sky_conn_id=sky_conn_id,
            poll_interval=poll_interval,
            grace=grace,
            lost_after=lost_after,
            hang_timeout=hang_timeout,
            **_result_kwargs(kwargs, result_file, result_ranks, result_max_bytes),
            **({"rank_task_id": rank_task_id} if rank_task_id else {}),
        )
        job_id = "{{ ti.xcom_pull(task_ids=" + repr(job_task_id) + ", key='sky_job_id', map_indexes=-1) }}"
        return cls(
            cluster=cluster,
            job_id=job_id,
            start_from_trigger=True,
            start_trigger_args=start,
            lost_after=lost_after,
            result_file=result_file,
            result_ranks=result_ranks,
            result_max_bytes=result_max_bytes,
            rank_task_id=rank_task_id,
            **watch,
            **kwargs,
        )

    @property
    def _job(self) -> str:
        if self.job_id:
            return str(self.job_id)
        if not self.ranks:
            raise ValueError("ranks / job_id: pass the job task's output as ranks=, or its job id as job_id=")
        return str(self.ranks[0]["job_id"])

    def _trigger(self, *, deferring: bool = True) -> SkyGangTrigger:
        return SkyGangTrigger(
            **self._watch_kwargs(self._job, deferring=deferring),
            **_result_kwargs(
                {"do_xcom_push": self.do_xcom_push},
                self.result_file,
                self.result_ranks,
                self.result_max_bytes,
            ),
            rank_task_id=self.rank_task_id,
        )

    def execute(self, context: Context) -> None:
        if self._already_over():
            # e.g. a rank failed at once and the job task's watcher cancelled the gang: no deferral,
            # so no triggerer round trip and no resume hold before the run can fail
            self.log.info("Job %s has already ended; reading its outcome now", self._job)
            return self.execute_complete(context, self._first_event(self._trigger(deferring=False)))
        self.defer(trigger=self._trigger(), method_name="execute_complete")

    def _already_over(self) -> bool:
        return self._peek(self._job).done

    def poke(self, context: Context) -> bool:  # only used if deferrable=False
        client = SkyHook(self.sky_conn_id).client(self.cluster)
        try:
            status = client.poll(self._job, max_log=0).status
        finally:
            client.close()
        if status.failed:
            client.cancel(status.job_id, grace=self.grace)
            raise AirflowFailException(status.failure_message())
        return status.succeeded

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        for line in gang_outcome(event):
            self.log.info("%s", line)
        if event["state"] != "succeeded":
            raise AirflowFailException(event["message"])
        self.log.info("%s", event["message"])
        outlet_extras(self.outlets, context, event)
        return event.get("result")


def _result_kwargs(
    operator_kwargs: dict[str, Any], result_file: str | None, result_ranks: int | str, max_bytes: int
) -> dict[str, Any]:
    """The gang trigger's result arguments: what to read once every rank succeeded (nothing when the
    task pushes no XCom) and whether a success resumes on a worker (a task with outlets)."""
    ranks, max_bytes = check_result_args(result_ranks, max_bytes)
    out: dict[str, Any] = {}
    if operator_kwargs.get("do_xcom_push", True):
        out["result"] = result_config(ranks, result_file, max_bytes)
    if operator_kwargs.get("outlets"):
        out["resume_on_success"] = True
    return out


def outlet_extras(outlets: Sequence[Any], context: Context, event: dict[str, Any]) -> None:
    """Fill the ``extra`` of each outlet asset's event: run id, job id, nodes, duration, a small result.

    Airflow emits an event per outlet when the task succeeds; only a gang that succeeded gets here.
    """
    if not outlets:
        return
    gang = event.get("gang") or {}
    ranks = gang.get("ranks") or []
    starts = [r["start"] for r in ranks if r.get("start")]
    ends = [r["end"] for r in ranks if r.get("end")]
    extra: dict[str, Any] = {
        "run_id": context["run_id"],
        "job_id": gang.get("job_id"),
        "nodes": len(ranks),
        "duration": round(max(ends) - min(starts), 3) if starts and ends else None,
    }
    if "result" in event and small(event["result"]):
        extra["result"] = event["result"]
    events = context["outlet_events"]
    for outlet in outlets:
        if isinstance(outlet, Asset):
            events[outlet].extra.update(extra)
