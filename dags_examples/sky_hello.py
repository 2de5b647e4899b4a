"""4 nodes on the local backend; each rank prints its rank, the node IPs and MASTER_ADDR."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_hello",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as dag:
    sky_gang(
        "hello",
        num_nodes=4,
        run='echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES on $(echo $SKYPILOT_NODE_IPS | cut -d" " -f'
        '$((SKYPILOT_NODE_RANK + 1))); node IPs: $(echo $SKYPILOT_NODE_IPS); MASTER_ADDR=$MASTER_ADDR"',
    )

if __name__ == "__main__":
    dag.test()
