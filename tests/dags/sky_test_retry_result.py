"""A retried gang's result is its successful attempt's: attempt 1 writes one result file, then rank 1
fails retryably; attempt 2 writes another and succeeds."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
mkdir -p out
printf '{"attempt": %s}' "$SKY_ATTEMPT" > out/result.json
if [ "$SKY_ATTEMPT" = 1 ]; then
    [ "$SKYPILOT_NODE_RANK" = 1 ] && exit 1
    sleep 10000
fi
"""

with DAG(
    "sky_test_retry_result", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang(
        "train",
        num_nodes=2,
        run=RUN,
        result_file="out/result.json",
        result_ranks="all",
        retries=1,
        retry_on_exit_codes=[1],
    )
