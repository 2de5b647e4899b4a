"""Reliability: a 64-rank gang on the local backend (such a run hung in state ``running``).

Every rank says which it is and sleeps a little, with ``TAG`` (``dag_run.conf["tag"]``) in its
environment so a test finds its processes in /proc.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_rel_wide",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "reliability"],
) as dag:
    sky_gang(
        "g",
        num_nodes=64,
        run='echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES up"; sleep 10',
        envs={"TAG": "{{ dag_run.conf.get('tag', 'none') }}"},
    )
