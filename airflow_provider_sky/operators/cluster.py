"""The setup task: provision N nodes (or reuse the cluster of that name) and run setup on all of them."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

from airflow.sdk import BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.backends.base import GPU_DEVICES, GPU_NAME, MACHINE_GPUS, Choice
from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.model.gang import job_id_for
from airflow_provider_sky.operators._args import check_operator_arguments
from airflow_provider_sky.operators._capacity import check_airflow_room
from airflow_provider_sky.operators._spec import (
    SPEC_FIELDS,
    SkySpecMixin,
    check_cluster_name,
    idle_down_for,
    log_autostop,
    pop_spec_fields,
    refuse_outlets,
    resolve_cluster_name,
    run_holder,
)
from airflow_provider_sky.operators.down import log_teardown, unclean_message
from airflow_provider_sky.spec import SpecError, TaskSpec, ignored_resources
from airflow_provider_sky.spec.timing import check_timing
from airflow_provider_sky.watch.jobs import DEFAULT_ORPHAN_TIMEOUT
from airflow_provider_sky.watch.setup_stage import SetupFailed, run_setup


class SkyClusterOperator(SkySpecMixin, BaseOperator):
    """Provision the cluster and run ``setup`` on every node in parallel; push the cluster handle.

    One node's setup failing stops the others' setups and fails this task with the failed ranks, their
    exit codes and the tail of their setup logs. Use it with ``.as_setup()`` and a
    :class:`~airflow_provider_sky.operators.down.SkyDownOperator` teardown, so nothing leaks.

    :param task_yaml: path of a SkyPilot task YAML (used as is).
    :param task_config: the same fields as a dict (instead of ``task_yaml``).
    :param num_nodes, run, setup, envs, secrets, resources, workdir, file_mounts, name: any field of
        the task given as a keyword argument; it overrides the YAML's (or dict's) value.
    :param cluster_name: defaults to one cluster per DAG run (``sky-<dag>-<hash of dag id and run id>``).
    :param sky_conn_id: a ``skylocal`` / ``skyssh`` / ``skykubernetes`` / ``skyaws`` connection; the default falls back to the local backend.
    :param down_on_failure: tear the cluster down when this task fails or is killed. Airflow skips a
        teardown task whose setup task failed, so without this a failed setup would leak the nodes.
    :param lease: hold a lease on the cluster for this DAG run (``<dag_id>/<run_id>``), released by the
        run's down task: while it is held, another run's teardown of the same ``cluster_name`` keeps the
        cluster. Set False when no down task of this run will release it (``sky_gang(down=False)``), so
        a later run's teardown can remove the cluster.
    :param orphan_timeout: the nodes kill the setup when nothing polled it for that many seconds (this
        task's worker died); 0 or None turns it off.
    :param idle_down: tear the cluster down on its nodes once nothing has run on it for that many
        seconds (SkyPilot's autodown, for a cluster kept with ``down=False``); 0: never; None: the
        YAML's ``resources.autostop`` if it has one (a stop there is a teardown here), else never.
    :param rank_tasks: one mapped rank task per node follows (``sky_gang``): check, before provisioning,
        that Airflow can map and watch that many (``[core] max_map_length``, ``[triggerer] capacity``).
    :param triggerers: how many triggerers share the watch (their capacity adds up).
    """

    template_fields: Sequence[str] = ("task_yaml", "task_config", "spec_overrides", "cluster_name")
    ui_color = "#e8f4ff"

    def __init__(
        self,
        *,
        task_yaml: str | None = None,
        task_config: Mapping[str, Any] | None = None,
        cluster_name: str | None = None,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        poll_interval: float = 0.5,
        grace: float = 3.0,
        down_on_failure: bool = True,
        lease: bool = True,
        orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT,
        idle_down: float | None = None,
        rank_tasks: bool = False,
        triggerers: int = 1,
        **kwargs: Any,
    ) -> None:
        overrides = pop_spec_fields(kwargs)  # before BaseOperator sees (and rejects) them
        check_operator_arguments(self, kwargs, *SPEC_FIELDS, task_id=kwargs.get("task_id"))
        check_timing(
            poll_interval=poll_interval,
            grace=grace,
            orphan_timeout=orphan_timeout,
            idle_down=idle_down,
            triggerers=triggerers,
        )
        super().__init__(**kwargs)
        refuse_outlets(self)
        self._init_spec(task_yaml, task_config, overrides)
        if cluster_name and "{" not in cluster_name:
            check_cluster_name(cluster_name)  # bad input fails at DAG parse time
        self.cluster_name = cluster_name
        self.sky_conn_id = sky_conn_id
        self.poll_interval = poll_interval
        self.grace = grace
        self.down_on_failure = down_on_failure
        self.lease = lease
        self.orphan_timeout = orphan_timeout
        self.idle_down = idle_down
        self.rank_tasks = rank_tasks
        self.triggerers = triggerers
        self._provisioning: str | None = None
        self._holder: str = ""

    def _down_after_failure(self, name: str) -> None:
        if not self.down_on_failure:
            self.log.warning("Keeping cluster %s after the failure (down_on_failure=False)", name)
            return
        self.log.info("Tearing down cluster %s after the failure, so no node leaks", name)
        try:
            result = SkyHook(self.sky_conn_id).teardown(name, grace=self.grace, holder=self._holder)
        except Exception:
            self.log.exception("Teardown of cluster %s failed", name)
            return
        log_teardown(self.log, name, result)
        if result.unclean:
            self.log.error("%s", unclean_message(name, result, self.sky_conn_id))

    def on_kill(self) -> None:
        if self._provisioning:
            self._down_after_failure(self._provisioning)

    def execute(self, context: Context) -> dict[str, Any]:
        hook = SkyHook(self.sky_conn_id)
        try:
            spec = self.rendered_spec(context)
            name = resolve_cluster_name(self.cluster_name, context)
            if self.rank_tasks:
                check_airflow_room(spec.num_nodes, self.triggerers)
            choice = hook.check(spec, name)
        except SpecError as exc:  # the task as written cannot run: no retry would change that
            raise AirflowFailException(str(exc)) from None
        self._holder = run_holder(context)
        backend = hook.get_backend()
        for field, why in (*spec.ignored, *ignored_resources(choice.resources, backend.capabilities)):
            self.log.warning("Ignored: %s: %s", field, why)
        log_autostop(self.idle_down, spec, cast(logging.Logger, self.log))
        self.log.info(
            "Provisioning cluster %s: %s node(s) on the %s backend; %s",
            name,
            spec.num_nodes,
            hook.get_backend().kind,
            choice.note(),
        )
        try:
            return self._provision_and_setup(hook, name, spec, context, choice)
        except BaseException:
            if self._provisioning:  # only a cluster we hold; a refused reuse leaves the other alone
                self._down_after_failure(name)
            raise
        finally:
            self._provisioning = None

    def _provision_and_setup(
        self, hook: SkyHook, name: str, spec: TaskSpec, context: Context, choice: Choice
    ) -> dict[str, Any]:
        # a backend cleans up its own half-made cluster; the lease keeps other runs' teardowns off it
        handle = hook.provision(name, spec, holder=self._holder if self.lease else None, choice=choice)
        self._provisioning = name
        hook.sync_files(handle, spec)
        for rank, node in enumerate(handle.nodes):
            gpus = node.extra.get(GPU_DEVICES)
            if gpus is not None:
                self.log.info(
                    "node rank %s: %s, GPUs %s (CUDA_VISIBLE_DEVICES=%s; the machine has %s)",
                    rank,
                    node.ip,
                    node.extra.get(GPU_NAME),
                    ",".join(str(d) for d in gpus),
                    node.extra.get(MACHINE_GPUS, "?"),
                )
            else:
                self.log.info("node rank %s: %s", rank, node.ip)
        if spec.setup:
            ti = context["ti"]
            job_id = job_id_for(ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number)
            self.log.info("Running setup on %s node(s) (job %s)", len(handle.nodes), job_id)
            client = hook.client(handle)
            try:
                run_setup(
                    client,
                    spec,
                    job_id,
                    on_log=lambda rank, line: self.log.info("(setup rank %s) %s", rank, line),
                    poll_interval=self.poll_interval,
                    grace=self.grace,
                    orphan_timeout=float(self.orphan_timeout or 0),
                    idle_down=idle_down_for(self.idle_down, spec),
                )
            except SetupFailed as exc:
                raise AirflowFailException(str(exc)) from exc
            finally:
                client.close()
            self.log.info("Setup succeeded on every node")
        return handle.to_dict()
