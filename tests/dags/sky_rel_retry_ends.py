"""Reliability DAGs of gang retries that do not save the gang, on the ``sky_rel_ssh`` hosts:

- ``sky_rel_retry_exhausted``: rank 1 exits 3 on every attempt; ``retries=2, retry_on_exit_codes=[3]``,
  so three attempts run and the run fails listing them all.
- ``sky_rel_retry_not_retryable``: rank 1 runs a command that does not exist (127) under
  ``retry_on_exit_codes="nonzero"``: 127 fails the same way every time, so no second attempt starts.

Every rank appends its job id to ``~/rel-<tag>.count`` on each start, so a case counts the attempts.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

START = pendulum.datetime(2026, 1, 1, tz="UTC")
COUNT = 'echo "$SKYPILOT_TASK_ID" >> "$HOME/rel-$TAG.count"\n'
ENVS = {"TAG": "{{ dag_run.conf.get('tag', 'none') }}"}

with DAG("sky_rel_retry_exhausted", schedule=None, start_date=START, catchup=False) as exhausted:
    sky_gang(
        "g",
        sky_conn_id="sky_rel_ssh",
        num_nodes=4,
        run=COUNT + 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 1; exit 3; fi; sleep 150',
        envs=ENVS,
        retries=2,
        retry_delay=1,
        retry_on_exit_codes=[3],
    )

with DAG("sky_rel_retry_not_retryable", schedule=None, start_date=START, catchup=False) as not_retryable:
    sky_gang(
        "g",
        sky_conn_id="sky_rel_ssh",
        num_nodes=4,
        run=COUNT
        + 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 1; no-such-command-here || exit $?; fi; sleep 150',
        envs=ENVS,
        retries=2,
        retry_delay=1,
        retry_on_exit_codes="nonzero",
    )
