"""The whole gang built from the SkyPilot task YAML kept beside this file."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_yaml", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False, tags=["sky"]
) as dag:
    sky_gang("yaml", task_yaml=str(Path(__file__).with_name("sky_yaml.yaml")))

if __name__ == "__main__":
    dag.test()
