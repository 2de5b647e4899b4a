"""sky_job_group over a two-task SkyPilot job group file (tests/integration/test_sky_job_group.py).

RENDEZVOUS (a directory every node can reach: they are all on this machine) and SERVER_EXIT are DAG params
(the run's conf sets them): 0 lets both tasks meet and succeed; 3 fails the server at once while the
client sleeps, so the group's stop task cancels it.
"""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.pipeline import sky_job_group

GROUP = Path(__file__).resolve().parent / "sky_test_job_group.yaml"

with DAG(
    "sky_test_job_group",
    schedule=None,
    start_date=pendulum.datetime(2024, 1, 1),
    params={"RENDEZVOUS": "/nonexistent", "SERVER_EXIT": "0"},
) as dag:
    sky_job_group(GROUP)
