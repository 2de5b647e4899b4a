"""Figure 4, Airflow's floor: sky_gang's DAG shape with no provider work in it.

The same tasks and hand-offs as ``bench_sky_true`` (cluster → job → 8 mapped rank tasks and a gang
sensor, both started and ended in the triggerer → a teardown), each task doing nothing: the rank
tasks' trigger (the standard provider's ``DateTimeTrigger``, a moment in the past) fires at once and
ends its task from the triggerer, as the provider's rank triggers do. What this run takes is what
Airflow's scheduler, executor and triggerer take for the shape; the provider cannot be faster.
``bench_floor_three_hops`` is the shape with the cluster and job tasks as one task (one hand-off
less), the least any gang of cluster, ranks and teardown can cost.
"""

from __future__ import annotations

from typing import Any

import pendulum
from airflow.sdk import DAG, TaskGroup

from benchmarks.floor import FloorOperator, in_triggerer

RANKS = 8
#: a moment long past: the trigger fires on its first run
PAST = pendulum.datetime(2020, 1, 1, tz="UTC")

#: how the rank tasks and the gang sensor start: in the triggerer, ended from there (TaskSuccessEvent)
IN_TRIGGERER: dict[str, Any] = in_triggerer(
    "airflow.providers.standard.triggers.temporal.DateTimeTrigger", {"moment": PAST, "end_from_trigger": True}
)


RANK_KWARGS = [{"value": i} for i in range(RANKS)]

#: dag id -> whether the cluster and job tasks are one task (one hand-off less)
SHAPES = {"bench_floor_true": False, "bench_floor_three_hops": True}

for dag_id, merged in SHAPES.items():
    with DAG(
        dag_id,
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        max_active_runs=1,
        tags=["bench"],
    ):
        with TaskGroup("gang"):
            job = FloorOperator(task_id="job", value=RANK_KWARGS)
            setup = job if merged else FloorOperator(task_id="cluster", value="handle")
            if not merged:
                setup >> job
            ranks = FloorOperator.partial(task_id="rank", **IN_TRIGGERER).expand_kwargs(job.output)
            gang = FloorOperator(task_id="gang", **IN_TRIGGERER)
            job >> [ranks, gang]
            setup >> [ranks, gang]  # sky_gang's watchers read the cluster task's handle: its edges too
            [ranks, gang] >> FloorOperator(task_id="down").as_teardown(setups=setup)
