"""Figure 5 (scale): one ``sky_gang`` of N ranks on the local backend (the default ``sky_default``).

For each N of ``BENCH_SCALE_NS`` (comma-separated, set by ``benchmarks.fig_scale``; default
64,256,1024):

``bench_scale_<N>``: every rank runs ``sleep 20`` (the run's overhead is its wall time minus 20 s).
``bench_scale_fail_<N>``: rank N//2 exits 3 after 5 s, the others ``sleep 10000``: only fail-fast
ends them (their cancellation and the run's failure are timed from rank N//2's own end timestamp).
``bench_scale_floor_<N>``: Airflow's floor for ``bench_scale_<N>`` (:mod:`benchmarks.floor`): the same
tasks and hand-offs with no provider work, the N rank tasks and the gang sensor started in the
triggerer and ended from there 20 s after the job task (each rank pushing a ``sky_rank``-sized XCom).
``bench_scale_warmup``: one rank runs ``true``, run once before anything is measured (the first task
of a new stack pays a start-up cost no later run does).

This folder is its own ``dags_folder`` (figure 5's stack parses only this file).
"""

from __future__ import annotations

import os

import pendulum
from airflow.sdk import DAG, TaskGroup

from airflow_provider_sky.taskgroup import sky_gang
from benchmarks.floor import FOLDER_ENV, FloorJobOperator, FloorOperator, in_triggerer

SECONDS = 20
SLEEP = f"sleep {SECONDS}"
FAIL = """\
if [ "$SKYPILOT_NODE_RANK" = "{rank}" ]; then
    sleep 5
    exit 3
fi
sleep 10000
"""

NS = [int(x) for x in os.environ.get("BENCH_SCALE_NS", "64,256,1024").split(",") if x.strip()]

DAGS = [("bench_scale_warmup", 1, "true")]
for n in NS:
    DAGS += [(f"bench_scale_{n}", n, SLEEP), (f"bench_scale_fail_{n}", n, FAIL.format(rank=n // 2))]

START = pendulum.datetime(2026, 1, 1, tz="UTC")
for dag_id, n, run in DAGS:
    with DAG(dag_id, schedule=None, start_date=START, catchup=False, max_active_runs=1, tags=["scale"]):
        sky_gang("gang", num_nodes=n, run=run)


def floor(n: int) -> None:
    """sky_gang's tasks and edges (cluster -> job -> N ranks + gang sensor -> down), doing nothing."""
    folder = os.environ.get(FOLDER_ENV, "/tmp/bench-floor")
    wait = "benchmarks.floor.FloorWaitTrigger"
    with TaskGroup("gang"):
        cluster = FloorOperator(task_id="cluster", value="handle")
        job = FloorJobOperator(task_id="job", seconds=SECONDS, value=[{"value": i} for i in range(n)])
        ranks = FloorOperator.partial(
            task_id="rank", **in_triggerer(wait, {"folder": folder, "xcom": True})
        ).expand_kwargs(job.output)
        gang = FloorOperator(task_id="gang", **in_triggerer(wait, {"folder": folder}))
        cluster >> job >> [ranks, gang]
        cluster >> [ranks, gang]  # sky_gang's watchers read the cluster task's handle
        [ranks, gang] >> FloorOperator(task_id="down").as_teardown(setups=cluster)


for n in NS:
    with DAG(f"bench_scale_floor_{n}", schedule=None, start_date=START, catchup=False, max_active_runs=1):
        floor(n)
