"""A 2-rank gang that runs until cancelled, on ``sky_default`` (a ``sky_aws`` connection on moto's server
in ``tests/e2e/test_aws_airflow.py``): a user marks rank 1 failed, and the teardown must leave no instance."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_aws_cancel",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "aws"],
) as dag:
    sky_gang("g", num_nodes=2, run='echo "rank $SKYPILOT_NODE_RANK started"\nsleep 300\n')
