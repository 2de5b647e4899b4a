"""The teardown task: always runs (``as_teardown``), idempotent, removes every node of the cluster."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowException

from airflow_provider_sky.backends import Teardown
from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.operators._args import check_operator_arguments
from airflow_provider_sky.operators._spec import resolve_cluster_name, run_holder
from airflow_provider_sky.spec.timing import check_timing


def log_teardown(log: Any, name: str, result: Teardown) -> None:
    """One line saying what a teardown did (kept for other runs, torn down, already gone)."""
    if result.kept_for:
        runs = ", ".join(result.kept_for)
        log.info(
            "Cluster %s kept: still used by run%s %s", name, "s" if len(result.kept_for) > 1 else "", runs
        )
    elif result.removed:
        log.info("Cluster %s torn down", name)
    elif not result.unclean:
        log.info("Cluster %s was already gone", name)


def unclean_message(name: str, result: Teardown, sky_conn_id: str | None) -> str:
    """Why the teardown is not done, which nodes, and how to finish it."""
    return (
        f"Cluster {name} not fully torn down: {len(result.unclean)} node(s) could not be cleaned, so "
        f"processes of the cluster may still run there: {'; '.join(result.unclean)}. The cluster record "
        "is kept, naming them. Once they answer again, clear (re-run) this down task, or run "
        f"SkyHook({sky_conn_id!r}).teardown({name!r}): it cleans only those nodes and removes the cluster."
    )


class SkyDownOperator(BaseOperator):
    """Release this DAG run's lease on the cluster and remove it when no other run holds one.

    Works by name, so it also cleans up a cluster whose setup task failed before pushing its handle; a
    cluster already gone is not an error. A cluster another run still uses (same ``cluster_name``) is
    kept, and the log names that run. Nodes that do not answer fail this task, naming them; clearing
    the task once they answer finishes the teardown.
    """

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
        check_operator_arguments(self, kwargs, task_id=kwargs.get("task_id"))
        check_timing(grace=grace)
        super().__init__(**kwargs)
        self.cluster_name = cluster_name
        self.sky_conn_id = sky_conn_id
        self.grace = grace

    def execute(self, context: Context) -> bool:
        name = resolve_cluster_name(self.cluster_name, context)
        result = SkyHook(self.sky_conn_id).teardown(name, grace=self.grace, holder=run_holder(context))
        log_teardown(self.log, name, result)
        if result.unclean:
            raise AirflowException(unclean_message(name, result, self.sky_conn_id))
        return result.removed
