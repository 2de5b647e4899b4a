"""Reliability: many runs of this DAG share the same hosts; ``conf={"fail": "1"}`` makes rank 2 exit 1.

Each run gets its own cluster (named after the run), so a failing run must never touch the ranks of
the others. Every rank appends a line to ``~/rel-<tag>.count`` on its node when it starts, then
waits for ``~/rel-<tag>.go`` (bounded), so a test can let every run's ranks go at the same moment
and the failing run's fail-fast happens while the other runs' ranks are running.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
echo "$SKYPILOT_TASK_ID" >> "$HOME/rel-$TAG.count"
echo "rank $SKYPILOT_NODE_RANK started (FAIL=$FAIL)"
i=0
while [ ! -f "$HOME/rel-$TAG.go" ] && [ "$i" -lt 600 ]; do sleep 0.2; i=$((i + 1)); done
if [ "$FAIL" = "1" ] && [ "$SKYPILOT_NODE_RANK" = "2" ]; then
    sleep 2
    exit 1
fi
sleep 8
echo "rank $SKYPILOT_NODE_RANK done"
"""

with DAG(
    "sky_rel_isolation",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=8,
    tags=["sky", "reliability"],
) as dag:
    sky_gang(
        "g",
        sky_conn_id="sky_rel_ssh",
        num_nodes=4,
        run=RUN,
        envs={
            "TAG": "{{ dag_run.conf.get('tag', 'none') }}",
            "FAIL": "{{ dag_run.conf.get('fail', '0') }}",
        },
    )
