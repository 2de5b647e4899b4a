"""A GPU gang from one of SkyPilot's examples (tests/data/skypilot_examples), used as it is; the arguments
replace run/setup by checks of what each rank sees and give alternatives for its accelerators (merged key by
key into the YAML's resources: its cpus stay). Run by tests/integration/test_gpu_dag.py on a machine with FAKE GPUs."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

YAML = Path(__file__).resolve().parent.parent / "data" / "skypilot_examples" / "mingpt_ddp_rdzv.yaml"
CHECK = (
    'echo "rank $SKYPILOT_NODE_RANK of $SKYPILOT_NUM_NODES sees $SKYPILOT_NUM_GPUS_PER_NODE GPUs: '
    'CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"\n'
    'test "$SKYPILOT_NUM_GPUS_PER_NODE" = 2\n'
    'test "$CUDA_VISIBLE_DEVICES" = "$(( SKYPILOT_NODE_RANK * 2 )),$(( SKYPILOT_NODE_RANK * 2 + 1 ))"\n'
)
SETUP = (
    'echo "setup $SKYPILOT_SETUP_NODE_RANK: $SKYPILOT_SETUP_NUM_GPUS_PER_NODE GPUs ($CUDA_VISIBLE_DEVICES)"'
)

with DAG(
    "sky_test_gpus", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang(
        "g",
        task_yaml=str(YAML),
        run=CHECK,
        setup=SETUP,
        resources={"accelerators": ["A100:8", "L4:2"]},
    )

if __name__ == "__main__":
    dag.test()
