"""A kept cluster (``down=False``) whose YAML asks for ``resources.autostop``: its nodes tear it down once
idle, as with ``idle_down`` (a stop becomes a teardown here, with one warning at launch)."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

YAML = str(Path(__file__).with_name("sky_test_autostop.yaml"))

with DAG(
    "sky_test_autostop", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    sky_gang("kept", task_yaml=YAML, cluster_name="sky-autostop-kept", down=False)
