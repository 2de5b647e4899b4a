"""airflow-provider-sky: run multi-node gangs (SkyPilot-style) from Airflow, failing fast."""

from __future__ import annotations

from typing import Any

from airflow_provider_sky.backends.registry import all_backends

__version__ = "0.1.0"


def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers list`` and the connection UI read (entry point ``apache_airflow_provider``)."""
    return {
        "package-name": "airflow-provider-sky",
        "name": "Sky (multi-node gangs)",
        "description": "Run multi-node jobs (gangs) that fail fast: local, SSH, Kubernetes and AWS EC2 backends.",
        "versions": [__version__],
        "operators": [
            {
                "integration-name": "Sky",
                "python-modules": [
                    "airflow_provider_sky.operators.cluster",
                    "airflow_provider_sky.operators.job",
                    "airflow_provider_sky.operators.rank",
                    "airflow_provider_sky.operators.down",
                ],
            }
        ],
        "sensors": [{"integration-name": "Sky", "python-modules": ["airflow_provider_sky.sensors.gang"]}],
        "triggers": [{"integration-name": "Sky", "python-modules": ["airflow_provider_sky.triggers.gang"]}],
        "hooks": [{"integration-name": "Sky", "python-modules": ["airflow_provider_sky.hooks.sky"]}],
        # @task.sky: Airflow's `task` object looks the name up here (ProvidersManager.taskflow_decorators)
        "task-decorators": [{"class-name": "airflow_provider_sky.decorators.sky.sky_task", "name": "sky"}],
        "integrations": [
            {"integration-name": "Sky", "external-doc-url": "https://docs.skypilot.co/", "tags": ["software"]}
        ],
        "connection-types": [
            entry
            for info in all_backends()
            for entry in info.provider_entries("airflow_provider_sky.hooks.sky")
        ],
    }
