"""The provider's Airflow plugin (entry point ``airflow.plugins``): the listener that writes a failed gang's
cause into the notes of its DAG run and rank tasks (:mod:`airflow_provider_sky.notes`)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_provider_sky import notes


class SkyPlugin(AirflowPlugin):
    name = "airflow_provider_sky"
    listeners = [notes]
