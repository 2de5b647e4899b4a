"""Reliability: the seed scenario on the ``sky_rel_ssh`` hosts, rank 2 exiting 1 at once.

Rank 2's first command is ``exit 1``: it fails while the job task is still starting the gang, before
any rank task or trigger exists. The others ``sleep 10000`` with ``TAG`` (``dag_run.conf["tag"]``) in
their environment, so a test finds them in /proc.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
if [ "$SKYPILOT_NODE_RANK" = "2" ]; then exit 1; fi
sleep 10000
"""

with DAG(
    "sky_rel_at_once",
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
