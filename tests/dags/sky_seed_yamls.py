"""The seed document's YAMLs, verbatim (``tests/seeds``): rank 2's run exits 1, rank 2's setup exits 1."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

# resolved: the file may be reached through a symlink (a DAG folder made for a test)
SEEDS = Path(__file__).resolve().parent.parent / "seeds"

with DAG(
    "sky_seed_failed_run",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "seed"],
) as failed_run:
    sky_gang("seed", task_yaml=str(SEEDS / "failed_worker_run.yaml"))

with DAG(
    "sky_seed_failed_setup",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    tags=["sky", "seed"],
) as failed_setup:
    sky_gang("seed", task_yaml=str(SEEDS / "failed_worker_setup.yaml"))
