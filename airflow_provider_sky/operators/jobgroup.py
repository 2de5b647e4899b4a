"""A job group's stop task: when one gang of the group failed, every other gang's job is cancelled."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.spec.timing import check_timing


class SkyJobGroupStopOperator(BaseOperator):
    """Runs as soon as one gang of a job group failed (trigger rule ``one_failed`` on every gang's
    sensor): cancels each gang's job that started (a finished one is left as it is), so the group fails
    together, then fails itself naming the group. ``gangs``: (label, cluster task id, job task id) per
    gang. ``sky_job_group`` builds it; it is skipped when every gang succeeded."""

    ui_color = "#ffe8e8"

    def __init__(
        self,
        *,
        group_name: str,
        gangs: Sequence[tuple[str, str, str]],
        sky_conn_id: str | None = SkyHook.default_conn_name,
        grace: float = 3.0,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("trigger_rule", "one_failed")
        super().__init__(**kwargs)
        check_timing(grace=grace)
        self.group_name = group_name
        self.gangs = [tuple(g) for g in gangs]
        self.sky_conn_id = sky_conn_id
        self.grace = grace

    def execute(self, context: Context) -> None:
        ti = context["ti"]
        hook = SkyHook(self.sky_conn_id)
        reason = f"job group {self.group_name}: another task of the group failed"
        stopped: list[str] = []
        for label, cluster_task, job_task in self.gangs:
            handle = ti.xcom_pull(task_ids=cluster_task)
            job_id = ti.xcom_pull(task_ids=job_task, key="sky_job_id")
            if not handle or not job_id:
                continue  # its job never started (a cluster failed, or it was not reached)
            try:
                hook.client(handle).cancel(str(job_id), grace=self.grace, reason=reason)
            except Exception as exc:  # one gang not reachable must not keep the others running
                self.log.warning("Job group %s: could not stop %s: %s", self.group_name, label, exc)
            else:
                stopped.append(label)
        raise AirflowFailException(
            f"job group {self.group_name}: a task of the group failed, so the group failed; stopped the "
            f"jobs of: {', '.join(stopped) or 'none (none was running)'}"
        )
