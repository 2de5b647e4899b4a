"""sky_pipeline over a two-task SkyPilot pipeline file; FIRST_EXIT (left null in it) given as a DAG param:
0 runs both tasks, 3 fails the first and stops the pipeline (tests/integration/test_sky_pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.pipeline import sky_pipeline

PIPELINE = Path(__file__).resolve().parent / "sky_test_sky_pipeline.yaml"

for dag_id, first_exit in (("sky_test_pipeline_ok", "0"), ("sky_test_pipeline_stops", "3")):
    with DAG(
        dag_id, schedule=None, start_date=pendulum.datetime(2024, 1, 1), params={"FIRST_EXIT": first_exit}
    ) as dag:
        sky_pipeline(PIPELINE)
    globals()[dag_id] = dag
