"""TaskFlow: ``@task.sky`` turns a function that returns the run command into a whole gang.

An upstream ``@task`` computes a value; the gang's function receives it (its XCom) at run time and
returns the command. Jinja in the returned string is rendered like any templated field.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG, task


@task
def steps() -> int:
    """What an upstream task computes, e.g. from the data it prepared."""
    return 3


@task.sky(
    num_nodes=4,
    resources={"cpus": "1+"},
    setup='echo "setup on node $SKYPILOT_SETUP_NODE_RANK of $SKYPILOT_NUM_NODES"',
    envs={"MASTER_PORT": "29512"},
)
def train(steps: int) -> str:
    """Every node runs the returned command; ``{{ run_id }}`` is rendered when the gang starts."""
    return (
        f'echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES: {steps} steps, '
        'master $MASTER_ADDR:$MASTER_PORT, run {{ run_id }}"'
    )


with DAG(
    "sky_taskflow",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as dag:
    train(steps())

if __name__ == "__main__":
    dag.test()
