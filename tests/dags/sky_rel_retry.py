"""Reliability DAG of whole-gang retries: a 4-rank gang on the ``sky_rel_ssh`` hosts with
``retries=2, retry_delay=8, retry_on_exit_codes=[1]``.

Every rank appends its job id to ``~/rel-<tag>.count`` on each start (so a case counts the attempts
that ran: ``SKYPILOT_TASK_ID`` is the same in each). In attempt 1 rank 1 exits 1 once
``~/rel-<tag>.fail`` exists; every other rank, and every rank of a later attempt, sleeps until cancelled.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
echo "$SKYPILOT_TASK_ID" >> "$HOME/rel-$TAG.count"
echo "rank $SKYPILOT_NODE_RANK started, attempt $SKY_ATTEMPT"
if [ "$SKY_ATTEMPT" = 1 ] && [ "$SKYPILOT_NODE_RANK" = "1" ]; then
    i=0
    while [ ! -f "$HOME/rel-$TAG.fail" ] && [ "$i" -lt 600 ]; do sleep 0.2; i=$((i + 1)); done
    echo "rank 1 fails now"
    exit 1
fi
sleep 150
"""

with DAG(
    "sky_rel_retry",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "reliability"],
) as dag:
    sky_gang(
        "g",
        sky_conn_id="sky_rel_ssh",
        num_nodes=4,
        run=RUN,
        envs={"TAG": "{{ dag_run.conf.get('tag', 'none') }}"},
        retries=2,
        retry_delay=8,
        retry_on_exit_codes=[1],
    )
