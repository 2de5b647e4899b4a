"""A SkyPilot pipeline file as gangs one after another (sky_pipeline), under dag.test() on the local backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.spec.yamlfile import load_pipeline_yaml

DAGS = Path(__file__).resolve().parents[1] / "dags"
PIPELINE = DAGS / "sky_test_sky_pipeline.yaml"


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def test_a_job_group_is_not_a_pipeline(tmp_path: Path) -> None:
    path = tmp_path / "group.yaml"
    path.write_text("name: g\nexecution: parallel\n---\nrun: a\n---\nrun: b\n")
    with pytest.raises(SpecError, match="a SkyPilot job group") as info:
        load_pipeline_yaml(path)
    assert info.value.field.endswith(": execution")
