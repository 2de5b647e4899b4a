"""One rank really segfaults (a NULL read through ctypes); its task's error says segmentation fault."""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
if [ "$SKYPILOT_NODE_RANK" = "1" ]; then
    sleep 1
    exec python3 -c 'import ctypes; ctypes.string_at(0)'
fi
sleep 10000
"""

with DAG(
    "sky_segfault",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as dag:
    sky_gang("crash", num_nodes=3, run=RUN)

if __name__ == "__main__":
    dag.test()
