"""What the UI test (tests/e2e/test_ui_browser.py) looks at: 4 ranks; rank 2 prints four lines 2 s apart (a blank
one among them) and fails; the others print a line and wait until they are cancelled."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
if [ "$SKYPILOT_NODE_RANK" = 2 ]; then
  echo "rank 2: step 1"; sleep 2
  echo "rank 2: step 2"; echo; sleep 2
  echo "rank 2: step 3"; sleep 2
  echo "rank 2: loss is NaN, giving up"
  exit 3
fi
echo "rank $SKYPILOT_NODE_RANK: training"
sleep 10000
"""

with DAG(
    "sky_test_ui",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "test"],
) as dag:
    sky_gang("train", num_nodes=4, run=RUN)
