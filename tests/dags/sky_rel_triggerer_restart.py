"""Reliability: the triggerer is restarted while every rank is deferred; fail-fast still works after.

Rank 1 exits 1 once ``~/rel-<tag>.fail`` exists on its node (the test creates it after the restart);
the other ranks sleep until they are cancelled.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
echo "$SKYPILOT_TASK_ID" >> "$HOME/rel-$TAG.count"
echo "rank $SKYPILOT_NODE_RANK started"
if [ "$SKYPILOT_NODE_RANK" = "1" ]; then
    i=0
    while [ ! -f "$HOME/rel-$TAG.fail" ] && [ "$i" -lt 600 ]; do sleep 0.2; i=$((i + 1)); done
    echo "rank 1 fails now"
    exit 1
fi
sleep 150
"""

with DAG(
    "sky_rel_triggerer_restart",
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
    )
