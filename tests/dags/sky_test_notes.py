"""Rank 1 says what went wrong and exits 3 (a CUDA error, as a training step would); the others sleep.
The run's note and the rank tasks' notes must say which rank failed first, why, and its last words."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
if [ "$SKYPILOT_NODE_RANK" = 1 ]; then
    echo "step 41 loss 2.31"
    echo "RuntimeError: CUDA error: an illegal memory access was encountered"
    sleep 1
    exit 3
fi
sleep 10000
"""

with DAG(
    "sky_test_notes", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang("train", num_nodes=3, run=RUN)

if __name__ == "__main__":
    dag.test()
