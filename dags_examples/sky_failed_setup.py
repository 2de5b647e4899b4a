"""Setup fails on one node (the seed's FAILED_SETUP case): the others' setups stop, no rank starts."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

SETUP = """\
echo "setting up node $SKYPILOT_SETUP_NODE_RANK of $SKYPILOT_NUM_NODES"
if [ "$SKYPILOT_SETUP_NODE_RANK" = "1" ]; then
    echo "pip install failed: no matching distribution" >&2
    exit 1
fi
sleep 10000
"""

with DAG(
    "sky_failed_setup",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as dag:
    sky_gang("train", num_nodes=3, setup=SETUP, run='echo "My hostname: $(hostname)"')

if __name__ == "__main__":
    dag.test()
