"""A job group's stop tasks: when one gang of the group failed, every other gang's job is cancelled;
when every primary gang succeeded, the auxiliary gangs are told to end (and end as succeeded)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.backends.base import ClusterHandle
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


#: the file (under a node's home) that tells an auxiliary task of a job group to end: ``.sky-jobgroup/
#: GROUP/RUN_ID``, holding the seconds it has left; its wrapper (:func:`auxiliary_run`) watches for it
STOP_DIR = ".sky-jobgroup"
#: the env var that names it, relative to the home (set per run: it holds the run id, templated)
STOP_ENV = "SKY_JOBGROUP_STOP"

_AUX_HEAD = """# SkyPilot job group: an auxiliary task, ended (as succeeded) once the primary tasks are done
(
"""
_AUX_TAIL = """
) &
sky_aux_pid=$!
trap 'exit 0' TERM
while kill -0 "$sky_aux_pid" 2>/dev/null; do
  if [ -n "${SKY_JOBGROUP_STOP:-}" ] && [ -f "$HOME/$SKY_JOBGROUP_STOP" ]; then
    sleep "$(cat "$HOME/$SKY_JOBGROUP_STOP")"
    kill -TERM 0
    exit 0
  fi
  sleep 1
done
wait "$sky_aux_pid"
"""


def auxiliary_run(run: str) -> str:
    """``run`` of an auxiliary task of a job group: it runs as written, in a subshell, while the rank's
    shell watches for the group's stop file; once there (every primary task succeeded) it waits the
    seconds the file holds (``termination_delay``), then ends the rank's processes and exits 0."""
    return _AUX_HEAD + run.rstrip("\n") + _AUX_TAIL


class SkyJobGroupEndOperator(BaseOperator):
    """Runs once every primary gang of a job group succeeded: writes the stop file on every node of each
    auxiliary gang (its seconds to finish first), which ends the auxiliary task as succeeded.
    ``gangs``: (label, cluster task id, seconds) per auxiliary gang. ``sky_job_group`` builds it."""

    ui_color = "#e8ffe8"

    def __init__(
        self,
        *,
        group_name: str,
        gangs: Sequence[tuple[str, str, float]],
        sky_conn_id: str | None = SkyHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.group_name = group_name
        self.gangs = [(str(label), str(task), float(delay)) for label, task, delay in gangs]
        self.sky_conn_id = sky_conn_id

    def execute(self, context: Context) -> None:
        ti = context["ti"]
        backend = SkyHook(self.sky_conn_id).get_backend()
        path = stop_path(self.group_name, str(context["run_id"]))
        for label, cluster_task, delay in self.gangs:
            handle = ti.xcom_pull(task_ids=cluster_task)
            if not handle:
                continue
            for node in ClusterHandle.from_dict(handle).nodes:
                res = backend.runner(node).run_script(
                    'mkdir -p "$1/${2%/*}" && printf "%s\\n" "$3" > "$1/$2.tmp" && mv "$1/$2.tmp" "$1/$2"',
                    [node.home, path, f"{float(delay):g}"],
                    timeout=60,
                )
                if res.returncode != 0:
                    self.log.warning(
                        "Job group %s: could not end %s on %s: %s",
                        self.group_name,
                        label,
                        node.ip,
                        res.error_text,
                    )
            self.log.info(
                "Job group %s: %s ends in %gs (the primary tasks are done)", self.group_name, label, delay
            )


def stop_path(group: str, run_id: str) -> str:
    """The stop file of a group's run, relative to a node's home. ``run_id``: the run's (Airflow's run
    ids are letters, digits and ``_.~:+-``), or the template ``{{ run_id }}`` for the task's env."""
    import re

    return f"{STOP_DIR}/{re.sub(r'[^A-Za-z0-9_.-]', '_', group)}/{run_id}"
