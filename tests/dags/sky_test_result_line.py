"""The default result (rank 0's last output line, masked like the log) and ``result_ranks="all"``."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task

from airflow_provider_sky.taskgroup import sky_gang


@task.sky(num_nodes=3, cluster_name="sky-result-line", secrets={"TOKEN": "s3cr3t-value"})
def train() -> str:
    return 'echo "noise"; echo "rank $SKYPILOT_NODE_RANK done, token $TOKEN"; echo'


@task
def evaluate(line: str, lines: list[str]) -> dict:
    return {"line": line, "lines": lines}


with DAG(
    "sky_test_result_line", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    every = sky_gang(
        "every",
        cluster_name="sky-result-every",
        num_nodes=2,
        run='echo "r$SKYPILOT_NODE_RANK"',
        result_ranks="all",
    )
    evaluate(train(), every.result)
