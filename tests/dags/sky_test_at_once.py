"""The seed scenario as written (``failed_worker_run.yaml``): rank 2 exits 1 at once, the others sleep 10000.

Rank 2 fails while the job task is still starting the gang, long before any rank task or trigger
runs: only the launch-side watcher (bridge) can cancel its siblings in time.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
if [ "$SKYPILOT_NODE_RANK" == "2" ]; then
    exit 1
fi
sleep 10000
"""

with DAG(
    "sky_test_at_once", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang("train", num_nodes=4, run=RUN)

if __name__ == "__main__":
    dag.test()
