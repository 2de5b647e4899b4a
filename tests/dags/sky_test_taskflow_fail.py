"""``@task.sky`` with the seed scenario: rank 2 exits 1 after 2 s, the others ``sleep 10000``."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task


@task.sky(num_nodes=4)
def train(failing_rank: int) -> str:
    return f"""\
if [ "$SKYPILOT_NODE_RANK" = "{failing_rank}" ]; then
    sleep 2
    exit 1
fi
sleep 10000
"""


with DAG(
    "sky_test_taskflow_fail", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    train(2)

if __name__ == "__main__":
    dag.test()
