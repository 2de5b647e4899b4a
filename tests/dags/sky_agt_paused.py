"""A 4-rank gang for the test of fail-fast with Airflow paused (``tests/e2e/test_k8s_agent_airflow.py``):
``sky_agt_paused`` on the ``sky_agt`` connection (Kubernetes pods with python3: node agents),
``sky_agt_paused_local`` on ``sky_agt_local`` (the local backend: one machine, its own cancel),
``sky_agt_paused_local_agents`` on ``sky_agt_local_agents`` (the local backend with ``node_agent``) and
``sky_agt_paused_ssh`` on ``sky_agt_ssh`` (4 sshd hosts, each its own user: node agents, on by default
over SSH). Rank 3 exits 1
once the file ``FAIL_FILE`` (``dag_run.conf["fail_file"]``, default ``/tmp/agt-fail`` on its node) exists,
which the test creates while every Airflow process is stopped; the others sleep until cancelled.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
echo "rank $SKYPILOT_NODE_RANK started"
if [ "$SKYPILOT_NODE_RANK" = "3" ]; then
    i=0
    while [ ! -f "$FAIL_FILE" ] && [ "$i" -lt 1500 ]; do sleep 0.2; i=$((i + 1)); done
    echo "rank 3 fails now"
    exit 1
fi
sleep 600
"""

for dag_id, conn_id in (
    ("sky_agt_paused", "sky_agt"),
    ("sky_agt_paused_local", "sky_agt_local"),
    ("sky_agt_paused_local_agents", "sky_agt_local_agents"),
    ("sky_agt_paused_ssh", "sky_agt_ssh"),
):
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        tags=["sky", "reliability"],
    ) as dag:
        sky_gang(
            "g",
            sky_conn_id=conn_id,
            num_nodes=4,
            run=RUN,
            envs={"FAIL_FILE": "{{ dag_run.conf.get('fail_file', '/tmp/agt-fail') }}"},
        )
    globals()[dag_id] = dag
