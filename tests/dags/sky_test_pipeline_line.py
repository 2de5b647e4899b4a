"""A gang without outlets: its sensor ends in the triggerer, which pushes rank 0's last line as its XCom."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task


@task.sky(num_nodes=2)
def train() -> str:
    return 'echo "warming up"; echo "rank $SKYPILOT_NODE_RANK says 42"'


@task
def evaluate(line: str) -> str:
    return line.upper()


with DAG(
    "sky_test_pipeline_line", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    evaluate(train())
