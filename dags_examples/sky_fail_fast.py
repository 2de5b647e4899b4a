"""The seed scenario: 4 nodes, rank 2 exits 1, the others ``sleep 10000``. The run fails in seconds."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
if [ "$SKYPILOT_NODE_RANK" == "2" ]; then
    sleep 2
    exit 1
fi
sleep 10000
"""

with DAG(
    "sky_fail_fast",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as dag:
    sky_gang("train", num_nodes=4, run=RUN)

if __name__ == "__main__":
    dag.test()
