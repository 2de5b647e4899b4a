"""Two ranks on the connection ``$SKY_TEST_CONN_ID`` (default ``sky_db``): the tests keep that connection in
the metadata DB, as ``airflow connections add`` does, never in an ``AIRFLOW_CONN_*`` variable."""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_test_db_conn", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang(
        "train",
        num_nodes=2,
        run='echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES found its connection"',
        sky_conn_id=os.environ.get("SKY_TEST_CONN_ID", "sky_db"),
    )

if __name__ == "__main__":
    dag.test()
