"""Two 2-rank gangs on ``sky_default`` (a ``sky_aws`` connection on moto's server in
``tests/e2e/test_aws_airflow.py``): ``sky_aws_cancel`` runs until cancelled (a user marks rank 1 failed,
and the teardown must leave no instance); in ``sky_aws_fail`` rank 1 exits 1 once the file ``FAIL_FILE``
(``dag_run.conf["fail_file"]``) exists, which the test creates while the triggerer is down, and rank 0
sleeps until cancelled."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

FAIL = """\
echo "rank $SKYPILOT_NODE_RANK started"
if [ "$SKYPILOT_NODE_RANK" = "1" ]; then
    i=0
    while [ ! -f "$FAIL_FILE" ] && [ "$i" -lt 1500 ]; do sleep 0.2; i=$((i + 1)); done
    echo "rank 1 fails now"
    exit 1
fi
sleep 600
"""

for dag_id, run, envs in (
    ("sky_aws_cancel", 'echo "rank $SKYPILOT_NODE_RANK started"\nsleep 300\n', {}),
    ("sky_aws_fail", FAIL, {"FAIL_FILE": "{{ dag_run.conf.get('fail_file', '/tmp/aws-fail') }}"}),
):
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        tags=["sky", "aws"],
    ) as dag:
        sky_gang("g", num_nodes=2, run=run, envs=envs)
    globals()[dag_id] = dag
