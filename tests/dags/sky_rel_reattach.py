"""Reliability: the job task's worker dies after the gang started; the retry re-attaches to it.

The job operator is a :class:`SkyJobOperator` subclass that, on try 1 only, writes its pid to
``dag_run.conf["pid_file"]`` once ``submit_job`` returned (the job id is in ``task_state_store``)
and then hangs, so a test can SIGKILL the task process at that point. Every rank appends a line to
``~/rel-<tag>.count`` on its node when it starts, then waits for ``~/rel-<tag>.go`` (bounded), so
the test can count how many times each rank was started.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pendulum
from airflow.sdk import DAG, TaskGroup

from airflow_provider_sky.operators.cluster import SkyClusterOperator
from airflow_provider_sky.operators.down import SkyDownOperator
from airflow_provider_sky.operators.job import SkyJobOperator
from airflow_provider_sky.operators.rank import SkyRankOperator
from airflow_provider_sky.sensors.gang import SkyGangSensor

CONN = "sky_rel_ssh"
RUN = """\
echo "$SKYPILOT_TASK_ID" >> "$HOME/rel-$TAG.count"
echo "rank $SKYPILOT_NODE_RANK started"
i=0
while [ ! -f "$HOME/rel-$TAG.go" ] && [ "$i" -lt 600 ]; do sleep 0.2; i=$((i + 1)); done
echo "rank $SKYPILOT_NODE_RANK done"
"""


class DyingWorkerJobOperator(SkyJobOperator):
    """Try 1 hangs right after the gang started (its pid in a file); later tries behave normally."""

    def poll_until_complete(self, external_id: Any, context: Any) -> None:
        super().poll_until_complete(external_id, context)
        pid_file = (context["dag_run"].conf or {}).get("pid_file")
        if context["ti"].try_number == 1 and pid_file:
            tmp = Path(f"{pid_file}.tmp")
            tmp.write_text(f"{os.getpid()}\n")
            tmp.replace(pid_file)
            self.log.info("Job %s started; pid %s now waits to be killed", external_id, os.getpid())
            time.sleep(60)


with DAG(
    "sky_rel_reattach",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "reliability"],
) as dag:
    spec: dict[str, Any] = {
        "num_nodes": 4,
        "run": RUN,
        "envs": {"TAG": "{{ dag_run.conf.get('tag', 'none') }}"},
    }
    watch: dict[str, Any] = {"sky_conn_id": CONN, "poll_interval": 0.5, "grace": 3.0}
    with TaskGroup("g"):
        cluster = SkyClusterOperator(task_id="cluster", **spec, **watch)
        job = DyingWorkerJobOperator(
            task_id="job",
            cluster=cluster.output,
            sky_conn_id=CONN,
            retries=1,
            retry_delay=timedelta(seconds=1),
            **spec,
        )
        ranks = SkyRankOperator.partial(task_id="rank", cluster=cluster.output, **watch).expand_kwargs(
            job.output
        )
        gang = SkyGangSensor(task_id="gang", cluster=cluster.output, ranks=job.output, **watch)
        job >> [ranks, gang]
        down = SkyDownOperator(task_id="down", sky_conn_id=CONN, grace=3.0)
        [ranks, gang] >> down.as_teardown(setups=cluster)
