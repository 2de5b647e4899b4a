"""A gang that runs until told to fail: rank 2 exits 1 once the file named in the run's conf ``go`` exists.

For the triggerer fault test (tests/e2e/test_airflow_celery.py): the ranks run while a triggerer is killed
and its triggers move to the other one; only then does the test make rank 2 fail.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
if [ "$SKYPILOT_NODE_RANK" = "2" ]; then
    while [ ! -e "{{ dag_run.conf.get('go', '/nonexistent/go') }}" ]; do sleep 0.2; done
    echo "rank 2 told to fail"
    exit 1
fi
sleep 10000
"""

with DAG(
    "sky_rel_triggerer_move",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
) as dag:
    sky_gang("gang", num_nodes=4, run=RUN, triggerers=2)
