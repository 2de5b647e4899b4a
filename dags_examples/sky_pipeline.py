"""A gang as one step of a data pipeline: prepare data, train on N nodes, evaluate, publish.

``train`` writes its metrics to ``~/out/result.json`` on rank 0: that file's JSON is the gang's result,
so ``evaluate(train(...))`` gets it as a dict once every rank succeeded. The gang updates the asset
``sky://checkpoints/pipeline`` only when every rank succeeded, so ``sky_pipeline_publish``, scheduled
on that asset, runs after a successful training and never after a failed one. Trigger ``sky_pipeline``
from the UI to change the number of nodes, the learning rate or the CPUs (its Params form).
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, Asset, Param, task

CHECKPOINT = Asset("sky://checkpoints/pipeline")


@task
def prepare() -> str:
    """Where the prepared data is (what an upstream extract/transform step returns)."""
    return "/data/prepared/shard-*"


@task.sky(
    num_nodes="{{ params.num_nodes }}",
    envs="{{ params.envs }}",
    resources="{{ params.resources }}",
    result_file="~/out/result.json",
    outlets=[CHECKPOINT],
)
def train(data: str) -> str:
    """Every rank trains; rank 0 writes the metrics the rest of the pipeline reads."""
    return (
        f'echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES trains on {data} (lr $LR)"\n'
        'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then\n'
        "  mkdir -p ~/out\n"
        '  printf \'{"loss": 0.25, "nodes": %s, "checkpoint": "ckpt/{{ run_id }}"}\\n\' '
        '"$SKYPILOT_NUM_NODES" > ~/out/result.json\n'
        "fi"
    )


@task
def evaluate(metrics: dict) -> float:
    """Runs once every rank succeeded, with rank 0's result.json as a dict."""
    print(f"evaluating {metrics['checkpoint']} trained on {metrics['nodes']} nodes: loss {metrics['loss']}")
    return float(metrics["loss"])


with DAG(
    "sky_pipeline",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
    params={
        "num_nodes": Param(2, type="integer", minimum=1, maximum=8, description="nodes of the gang"),
        "envs": Param({"LR": "0.001"}, type="object", description="environment of every rank"),
        "resources": Param({"cpus": "1+"}, type="object", description="what each node needs"),
    },
) as dag:
    evaluate(train(prepare()))


@task
def publish(triggering_asset_events: dict | None = None) -> dict:
    """Reads the training's asset event: its run, nodes, duration and result (``extra``)."""
    events = (triggering_asset_events or {}).get(CHECKPOINT, [])
    extra = dict(events[-1].extra) if events else {}
    print(f"publishing the checkpoint of run {extra.get('run_id')}: {extra.get('result')}")
    return extra


with DAG(
    "sky_pipeline_publish",
    schedule=[CHECKPOINT],
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as publish_dag:
    publish()

if __name__ == "__main__":
    dag.test()
