"""A secrets backend for tests: it refuses every lookup (``AirflowSecretsBackendAccessDenied``), as a
Vault policy that denies the worker's role does."""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowSecretsBackendAccessDenied
from airflow.secrets import BaseSecretsBackend


class DenyingSecretsBackend(BaseSecretsBackend):
    def get_conn_value(self, conn_id: str, team_name: str | None = None) -> str | None:
        raise AirflowSecretsBackendAccessDenied(f"policy denies reading connection {conn_id}")

    def get_connection(self, conn_id: str, team_name: str | None = None) -> Any:
        raise AirflowSecretsBackendAccessDenied(f"policy denies reading connection {conn_id}")
