"""A gang with an outlet whose rank 1 fails: no result, no asset event, so its consumer never runs."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Asset, task

from airflow_provider_sky.taskgroup import sky_gang

FAILING = Asset("sky://checkpoints/failing")


@task
def evaluate(result: str) -> str:
    return result


with DAG(
    "sky_test_pipeline_fail", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    gang = sky_gang(
        "train",
        num_nodes=2,
        run='echo "rank $SKYPILOT_NODE_RANK"; [ "$SKYPILOT_NODE_RANK" = 1 ] && exit 3; sleep 1',
        outlets=[FAILING],
    )
    evaluate(gang.result)


@task
def consume() -> str:
    return "ran"


with DAG(
    "sky_test_pipeline_fail_consumer",
    schedule=[FAILING],
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
) as consumer:
    consume()
