"""Reliability: a node dies mid-run; its rank is reported lost after 3 s and the gang fails fast."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
echo "$SKYPILOT_TASK_ID" >> "$HOME/rel-$TAG.count"
echo "rank $SKYPILOT_NODE_RANK started"
sleep 150
"""

with DAG(
    "sky_rel_node_loss",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "reliability"],
) as dag:
    sky_gang(
        "g",
        sky_conn_id="sky_rel_ssh",
        lost_after=3,
        num_nodes=4,
        run=RUN,
        envs={"TAG": "{{ dag_run.conf.get('tag', 'none') }}"},
    )
