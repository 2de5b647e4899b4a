"""Whole-gang retries: rank 2 fails on the first attempt, the whole gang runs again and succeeds.

``retries=2, retry_on_exit_codes=[1]``: rank 2 exits 1 on attempt 1 (``$SKY_ATTEMPT``), its siblings are
cancelled, every process of attempt 1 is gone, then all 4 ranks start again together; on attempt 2 each
rank checks that no process of attempt 1 is left and succeeds. The rank tasks stay the same through
both attempts: their logs show the boundary and why, and ``sky_rank`` lists both attempts.
``SKYPILOT_TASK_ID`` is the same in both.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
echo "rank $SKYPILOT_NODE_RANK, attempt $SKY_ATTEMPT of job $SKYPILOT_TASK_ID"
if [ "$SKY_ATTEMPT" == "1" ]; then
    if [ "$SKYPILOT_NODE_RANK" == "2" ]; then sleep 1; exit 1; fi
    sleep 10000
fi
left=0
for f in $(grep -l -a -F "SKYPILOT_TASK_ID=$SKYPILOT_TASK_ID" /proc/[0-9]*/environ 2>/dev/null); do
    grep -q -a -F "SKY_ATTEMPT=1" "$f" 2>/dev/null && left=$((left + 1))
done
echo "processes of attempt 1 still alive: $left"
[ "$left" = 0 ]
"""

with DAG(
    "sky_retry",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as dag:
    sky_gang("train", num_nodes=4, run=RUN, retries=2, retry_delay=1, retry_on_exit_codes=[1])

if __name__ == "__main__":
    dag.test()
