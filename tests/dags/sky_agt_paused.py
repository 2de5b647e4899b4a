"""A 4-rank gang on the ``sky_agt`` connection (Kubernetes pods with python3: node agents), for the test
of fail-fast with Airflow paused (``tests/test_k8s_agent_airflow.py``): rank 3 exits 1 once
``/tmp/agt-fail`` exists in its pod (the test creates it through the exec API while every Airflow
process is stopped); the others sleep until cancelled.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
echo "rank $SKYPILOT_NODE_RANK started"
if [ "$SKYPILOT_NODE_RANK" = "3" ]; then
    i=0
    while [ ! -f /tmp/agt-fail ] && [ "$i" -lt 1500 ]; do sleep 0.2; i=$((i + 1)); done
    echo "rank 3 fails now"
    exit 1
fi
sleep 600
"""

with DAG(
    "sky_agt_paused",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "reliability"],
) as dag:
    sky_gang("g", sky_conn_id="sky_agt", num_nodes=4, run=RUN)
