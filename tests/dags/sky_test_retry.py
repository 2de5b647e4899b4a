"""Retries that do not save the gang: retries exhausted (rank 1 exits 3 every time) and an exit code that
is never retried by default (127, command not found, with retry_on_exit_codes="nonzero")."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

START = pendulum.datetime(2026, 1, 1, tz="UTC")
RUN = 'if [ "$SKYPILOT_NODE_RANK" == "1" ]; then sleep 0.5; exit 3; fi; sleep 10000'

with DAG("sky_test_retry_exhausted", schedule=None, start_date=START, catchup=False) as exhausted:
    sky_gang("train", num_nodes=2, run=RUN, retries=2, retry_on_exit_codes=[3])

with DAG("sky_test_retry_not_retryable", schedule=None, start_date=START, catchup=False) as not_retryable:
    sky_gang(
        "train",
        num_nodes=2,
        run='if [ "$SKYPILOT_NODE_RANK" == "1" ]; then no-such-command-here || exit $?; fi; sleep 10000',
        retries=2,
        retry_on_exit_codes="nonzero",
    )
