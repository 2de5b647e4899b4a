"""Reliability DAGs of one shape: a 4-rank gang on the ``sky_rel_ssh`` hosts, one per fault case.

Every rank first appends its job id to ``~/rel-<tag>.count`` on its node (one line per start), with
``<tag>`` from ``dag_run.conf["tag"]``, so a case can count starts and drive its ranks through files.

- ``sky_rel_mark_failed``: a user marks one deferred rank failed; the whole gang is cancelled.
- ``sky_rel_node_loss``: a node dies mid-run; its rank is reported lost after 3 s, the gang fails.
- ``sky_rel_triggerer_restart``: the triggerer restarts while every rank is deferred; rank 1 exits 1
  once ``~/rel-<tag>.fail`` exists (created after the restart); the others sleep until cancelled.
- ``sky_rel_isolation``: many runs share the hosts, each its own cluster; every rank waits for
  ``~/rel-<tag>.go`` (bounded), then with ``conf={"fail": "1"}`` rank 2 exits 1, so the failing run's
  fail-fast happens while the other runs' ranks are running.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

START = """\
echo "$SKYPILOT_TASK_ID" >> "$HOME/rel-$TAG.count"
echo "rank $SKYPILOT_NODE_RANK started"
"""

WAIT_FOR_FAIL_FILE = """\
if [ "$SKYPILOT_NODE_RANK" = "1" ]; then
    i=0
    while [ ! -f "$HOME/rel-$TAG.fail" ] && [ "$i" -lt 600 ]; do sleep 0.2; i=$((i + 1)); done
    echo "rank 1 fails now"
    exit 1
fi
sleep 150
"""

WAIT_FOR_GO_FILE = """\
echo "FAIL=$FAIL"
i=0
while [ ! -f "$HOME/rel-$TAG.go" ] && [ "$i" -lt 600 ]; do sleep 0.2; i=$((i + 1)); done
if [ "$FAIL" = "1" ] && [ "$SKYPILOT_NODE_RANK" = "2" ]; then
    sleep 2
    exit 1
fi
sleep 8
echo "rank $SKYPILOT_NODE_RANK done"
"""

TAG = {"TAG": "{{ dag_run.conf.get('tag', 'none') }}"}

#: dag id -> (the rank's command after START, extra DAG arguments, extra sky_gang arguments)
CASES: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "sky_rel_mark_failed": ("sleep 150\n", {}, {}),
    "sky_rel_node_loss": ("sleep 150\n", {}, {"lost_after": 3}),
    "sky_rel_triggerer_restart": (WAIT_FOR_FAIL_FILE, {}, {}),
    "sky_rel_isolation": (
        WAIT_FOR_GO_FILE,
        {"max_active_runs": 8},
        {"envs": {**TAG, "FAIL": "{{ dag_run.conf.get('fail', '0') }}"}},
    ),
}

for dag_id, (run, dag_args, gang_args) in CASES.items():
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        tags=["sky", "reliability"],
        **dag_args,
    ) as dag:
        sky_gang("g", sky_conn_id="sky_rel_ssh", num_nodes=4, run=START + run, **{"envs": TAG, **gang_args})
    globals()[dag_id] = dag
