"""The teardown task: always runs (``as_teardown``), idempotent, removes every node of the cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._spec import resolve_cluster_name


class SkyDownOperator(BaseOperator):
    """Kill everything the cluster runs and release its nodes. Works by name, so it also cleans up a
    cluster whose setup task failed before pushing its handle; a cluster already gone is not an error."""

    template_fields: Sequence[str] = ("cluster_name",)
    ui_color = "#eeeeee"

    def __init__(
        self,
        *,
        cluster_name: str | None = None,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        grace: float = 3.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.cluster_name = cluster_name
        self.sky_conn_id = sky_conn_id
        self.grace = grace

    def execute(self, context: Any) -> bool:
        name = resolve_cluster_name(self.cluster_name, context)
        removed = SkyHook(self.sky_conn_id).teardown(name, grace=self.grace)
        self.log.info("Cluster %s %s", name, "torn down" if removed else "was already gone")
        return removed
