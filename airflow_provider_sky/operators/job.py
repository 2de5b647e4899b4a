"""Gang start: one task starts every rank at once; mapped rank tasks then attach to their rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.bases.resumablejobmixin import ResumableJobMixin
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.gang import job_id_for
from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.jobs import LaunchError
from airflow_provider_sky.operators._spec import SkySpecMixin, pop_spec_fields


class SkyJobOperator(SkySpecMixin, ResumableJobMixin, BaseOperator):
    """Start ``run`` on every node of the cluster at once and return one entry per rank to map over.

    Why one task starts all ranks: under ``dag.test()`` (and with few worker slots) mapped tasks run
    one at a time, so rank 0 would wait forever for peers that never start. Starting them together
    also bounds the start skew. The job id is kept in ``task_state_store``: a worker that dies after
    the launch re-attaches on retry and never starts a rank twice.

    :param cluster: the cluster handle (``cluster_task.output``).
    :param task_yaml, task_config, num_nodes, run, ...: the task, as for :class:`SkyClusterOperator`.
    """

    template_fields: Sequence[str] = ("task_yaml", "task_config", "spec_overrides", "cluster")
    external_id_key = "sky_job_id"
    ui_color = "#fff3e0"

    def __init__(
        self,
        *,
        cluster: Any,
        task_yaml: str | None = None,
        task_config: Mapping[str, Any] | None = None,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        **kwargs: Any,
    ) -> None:
        overrides = pop_spec_fields(kwargs)  # before BaseOperator sees (and rejects) them
        super().__init__(**kwargs)
        self._init_spec(task_yaml, task_config, overrides)
        self.cluster = cluster
        self.sky_conn_id = sky_conn_id

    def execute(self, context: Any) -> list[dict[str, Any]]:
        result = self.execute_resumable(context)
        # on a re-attach the mixin returns poll_until_complete()'s value (None): build the ranks here
        return result if result is not None else self.get_job_result(self._job_id, context)

    def _hook(self) -> SkyHook:
        return SkyHook(self.sky_conn_id)

    def submit_job(self, context: Any) -> str:
        spec = self.rendered_spec()
        ti = context["ti"]
        job_id = job_id_for(ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number)
        client = self._hook().client(self.cluster)
        if len(client.handle.nodes) != spec.num_nodes:
            raise AirflowFailException(
                f"num_nodes: the task asks for {spec.num_nodes} nodes but cluster {client.handle.name} has "
                f"{len(client.handle.nodes)}; give the cluster and job tasks the same task spec"
            )
        self.log.info(
            "Starting %s rank(s) of job %s on cluster %s", spec.num_nodes, job_id, client.handle.name
        )
        try:
            started = client.launch(spec, job_id)
        except LaunchError as exc:
            raise AirflowFailException(f"gang start failed, no rank left running: {exc}") from exc
        finally:
            client.close()
        self.log.info("Started: %s", started)
        return job_id

    def get_job_status(self, external_id: Any, context: Any) -> str:
        client = self._hook().client(self.cluster)
        try:
            status = client.poll(str(external_id), max_log=0).status
        finally:
            client.close()
        if status.succeeded:
            return "succeeded"
        if status.failed or status.done:
            return "failed"
        return "running"

    def is_job_active(self, status: str) -> bool:
        return status == "running"

    def is_job_succeeded(self, status: str) -> bool:
        return status == "succeeded"

    def poll_until_complete(self, external_id: Any, context: Any) -> None:
        """Nothing to wait for here: the rank tasks and the gang sensor watch the job."""
        self._job_id = str(external_id)

    def get_job_result(self, external_id: Any, context: Any) -> list[dict[str, Any]]:
        handle = self.cluster
        return [{"rank": i, "job_id": str(external_id), "ip": n["ip"]} for i, n in enumerate(handle["nodes"])]
