"""A task without ``run`` (SkyPilot's cluster YAML) sets the cluster up; a later gang runs on it by name."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

with DAG(
    "sky_test_setup_only", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC"), catchup=False
) as dag:
    prepared = sky_gang(
        "prepare",
        task_yaml=str(Path(__file__).with_name("sky_test_setup_only.yaml")),
        cluster_name="sky-setup-only",
        down=False,
    )
    used = sky_gang("use", num_nodes=2, run="cat ~/ready", cluster_name="sky-setup-only")
    prepared >> used
