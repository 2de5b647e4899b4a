"""Figure 4, this provider: 8 ranks through ``sky_gang`` on the ``sky_bench`` (sky_ssh) connection.

``bench_sky_true``: every rank runs ``true``. ``bench_sky_fail_fast``: rank 2 exits 1 after 2 s, the
others ``sleep 10000`` (the run fails as soon as the gang fails; siblings are cancelled).
``bench_sky_at_once``: the same with rank 2 exiting at once (the seed scenario as written), long
before any rank task runs: only the job task's launch-side watcher can cancel the siblings then.
The connection comes from ``AIRFLOW_CONN_SKY_BENCH``, set by ``benchmarks.run``.
"""

from __future__ import annotations

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

RANKS = 8
FAIL = """\
if [ "$SKYPILOT_NODE_RANK" = "2" ]; then
    sleep 2
    exit 1
fi
sleep 10000
"""

AT_ONCE = FAIL.replace("    sleep 2\n", "")

for dag_id, run in (
    ("bench_sky_true", "true"),
    ("bench_sky_fail_fast", FAIL),
    ("bench_sky_at_once", AT_ONCE),
):
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        tags=["bench"],
    ):
        sky_gang("gang", num_nodes=RANKS, run=run, sky_conn_id="sky_bench")
