"""A SkyPilot YAML whose bucket ``name:`` is left null: given at launch by the ``file_mounts`` argument
(here from a DAG param, through a template), or never given."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

YAML = str(Path(__file__).with_name("sky_test_bucket_name.yaml"))
START = pendulum.datetime(2026, 1, 1, tz="UTC")
BUCKET = "named-at-launch"

with DAG(
    "bucket_name_param", schedule=None, start_date=START, catchup=False, params={"bucket": BUCKET}
) as given:
    sky_gang("g", task_yaml=YAML, file_mounts={"~/data": {"name": "{{ params.bucket }}"}})

with DAG("bucket_name_missing", schedule=None, start_date=START, catchup=False) as missing:
    sky_gang("g", task_yaml=YAML)
