"""Hang detection: ranks 1 and 3 get stuck (a collective that never returns), ranks 0 and 2 keep going.

Ranks 1 and 3 wait for ever on a lock from their start, without a word (``sleep`` where the node has no
Python): silent from the start, their silence is timed from the watcher's first poll of each, the same
poll for both, so the verdict names both. (Had each printed a line first, each silence would start at
that line, and ranks that start a few polls apart on a loaded machine fall silent that far apart: the
verdict then names only those silent for the whole timeout, see ``watch/hang.py``.)
Rank 0 prints a line every second; rank 2 prints nothing but touches its progress file
(``$SKY_PROGRESS_FILE``) every second: both count as alive. After ``hang_timeout`` seconds of
silence the stacks of ranks 1 and 3 go into their logs and the run fails with
``hung: no output for 10 s (ranks 1, 3)``. Real jobs use minutes (NCCL's own timeout is 600 s).
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RUN = """\
case "$SKYPILOT_NODE_RANK" in
  1|3) if command -v python3 >/dev/null; then exec python3 -c 'import threading; threading.Event().wait()'; fi
       exec sleep 100000 ;;
  0) i=0; while :; do i=$((i + 1)); echo "rank 0: step $i"; sleep 1; done ;;
  *) while :; do touch "$SKY_PROGRESS_FILE"; sleep 1; done ;;
esac
"""

with DAG(
    "sky_hang",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky"],
) as dag:
    sky_gang("train", num_nodes=4, run=RUN, hang_timeout=10)

if __name__ == "__main__":
    dag.test()
