"""Whole-gang retries under dag.test() on the local backend: real processes, real Airflow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"retries": -1}, "retries: expected a whole number of gang retries from 0 to 100, got -1"),
        ({"retries": "2"}, "retries: expected a whole number"),
        ({"retries": 1, "retry_delay": "5"}, "retry_delay: expected seconds (or a timedelta), got '5'"),
        (
            {"retries": 1, "retry_exponential_backoff": "yes"},
            "retry_exponential_backoff: expected True or False",
        ),
        ({"retries": 1, "retry_on_exit_codes": 1}, "retry_on_exit_codes: expected a list of exit codes"),
        ({"retries": 1, "retry_on_exit_codes": "all"}, "retry_on_exit_codes: expected a list of exit codes"),
        ({"retries": 1, "retry_on_exit_codes": [0]}, "retry_on_exit_codes: 0 is not a nonzero exit code"),
    ],
)
def test_bad_retry_arguments_fail_when_the_dag_is_parsed(kwargs: dict[str, object], error: str) -> None:
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_sky.taskgroup import sky_gang

    with pytest.raises(ValueError, match=re.escape(error)):
        with DAG("bad_retry", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
            sky_gang("g", num_nodes=2, run="true", **kwargs)
