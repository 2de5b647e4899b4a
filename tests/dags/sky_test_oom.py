"""Rank 1 grows until the kernel's OOM killer ends it (run it only where a memory limit is set: the tests
put the node in a memory-limited cgroup); rank 0 sleeps. Rank 1 must read "out of memory", rank 0 cancelled.

``SKY_TEST_OOM_SCORE``: the growing rank's ``oom_score_adj`` (the local backend's test shares its cgroup with
Airflow itself, and makes sure the kernel picks the rank).
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

GROW = """\
import os
score = os.environ.get("SKY_TEST_OOM_SCORE")
if score:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write(score)
print("rank 1: growing", flush=True)
held = []
for _ in range(64):  # 4 GiB at most, every page written (not lazy zero pages), so all of it is charged
    held.append(b"x" * (64 << 20))
print("rank 1: never killed", flush=True)
"""

RUN = f"""\
if [ "$SKYPILOT_NODE_RANK" == "1" ]; then
    exec python3 -c '{GROW}'
fi
sleep 10000
"""

with DAG(
    "sky_test_oom", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang(
        "train", num_nodes=2, run=RUN, envs={"SKY_TEST_OOM_SCORE": os.environ.get("SKY_TEST_OOM_SCORE", "")}
    )

if __name__ == "__main__":
    dag.test()
