"""One SkyPilot YAML with null envs/secrets, its values given four ways (one: never)."""

from __future__ import annotations

from pathlib import Path

import pendulum
from airflow.sdk import DAG

from airflow_provider_sky.taskgroup import sky_gang

TOKEN = "tok-launch-5e1d9c"
YAML = str(Path(__file__).with_name("sky_test_launch_values.yaml"))
START = pendulum.datetime(2026, 1, 1, tz="UTC")

#: dag id -> (DAG params, sky_gang arguments); the variable case sets AIRFLOW_VAR_API_TOKEN itself
CASES: dict[str, tuple[dict[str, str], dict[str, object]]] = {
    "launch_values_args": ({}, {"envs": {"GREETING": "hi"}, "secrets": {"API_TOKEN": TOKEN}}),
    "launch_values_params": ({"GREETING": "from-params", "API_TOKEN": TOKEN}, {}),
    "launch_values_variable": ({"GREETING": "p"}, {}),
    "launch_values_missing": ({"UNRELATED": "x"}, {}),
}
DAGS: dict[str, DAG] = {}
for dag_id, (params, gang) in CASES.items():
    with DAG(dag_id, schedule=None, start_date=START, catchup=False, params=params) as dag:
        sky_gang("g", task_yaml=YAML, **gang)  # type: ignore[arg-type]
    DAGS[dag_id] = dag
