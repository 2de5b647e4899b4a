"""Gang start: one task starts every rank at once; mapped rank tasks then attach to their rank."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from airflow.sdk import BaseOperator, Context
from airflow.sdk.bases.resumablejobmixin import ResumableJobMixin
from airflow.sdk.exceptions import AirflowFailException

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.model.gang import job_id_for
from airflow_provider_sky.operators._args import check_operator_arguments
from airflow_provider_sky.operators._spec import (
    SPEC_FIELDS,
    SkySpecMixin,
    idle_down_for,
    pop_spec_fields,
    refuse_outlets,
)
from airflow_provider_sky.operators._watch import WatchFields
from airflow_provider_sky.spec import SpecError, TaskSpec
from airflow_provider_sky.spec.nodes import FIELD, job_cluster, num_nodes_problem
from airflow_provider_sky.watch.bridge import Bridge, BridgeError, BridgeRequest, log_path_for, start_bridge
from airflow_provider_sky.watch.jobs import DEFAULT_ORPHAN_TIMEOUT, GangClient, LaunchError
from airflow_provider_sky.watch.retry import operator_policy
from airflow_provider_sky.watch.settings import WatchSettings


class SkyJobOperator(WatchFields, SkySpecMixin, ResumableJobMixin, BaseOperator):
    """Start ``run`` on every node of the cluster at once and return one entry per rank to map over.

    Why one task starts all ranks: under ``dag.test()`` (and with few worker slots) mapped tasks run
    one at a time, so rank 0 would wait forever for peers that never start. Starting them together
    also bounds the start skew. The job id is kept in ``task_state_store``: a worker that dies after
    the launch re-attaches on retry and never starts a rank twice.

    Why a bridge: the rank tasks, whose triggers run the fail-fast, only start once this task ended,
    so the launch goes through a small detached watcher (:mod:`airflow_provider_sky.watch.bridge`) started
    first. It watches the gang from the instant the ranks exist until the triggers' shared poll takes
    over (and again whenever that poll lapses), then exits when the job is over. A cluster whose node
    agents decide the gang's fate on its head node (``docs/node-agent.md``) needs none: the launch is one
    call to the head from this task, and the head fails the gang fast, finds hung ranks and keeps the
    dead-man's switch; the rank tasks' triggers start each next attempt of a gang with retries.

    :param cluster: the cluster handle (``cluster_task.output``).
    :param task_yaml, task_config, num_nodes, run, ...: the task, as for :class:`SkyClusterOperator`.
    :param poll_interval, grace, lost_after: how the bridge watches (as the rank tasks' triggers do).
    :param orphan_timeout: the nodes kill the job when nothing polled it for that many seconds (a lost
        scheduler, a killed ``dags test``); 0 or None turns it off.
    :param bridge: start the launch-side watcher where the cluster has no node agents (False: launch
        from this task, nothing on the Airflow side watches the gang until the triggers run).
    :param bridge_timeout: the bridge gives up after this many seconds without any other watcher
        (default: ``orphan_timeout``, or 300 s when that is off).
    :param idle_down: tear the cluster down on its nodes once nothing has run on it for that many
        seconds (SkyPilot's autodown, for a cluster kept with ``down=False``); 0: never; None: the
        YAML's ``resources.autostop`` if it has one, else never. Give the cluster task the same value.
    :param gang_retries, gang_retry_delay, gang_retry_exponential_backoff, retry_on_exit_codes: whole-gang
        retries (see ``sky_gang``'s ``retries``; ``gang_`` because ``retries`` is Airflow's retry of this
        task alone). Give the rank tasks and the gang sensor the same values.
    :param hang_timeout: a running rank that printed nothing (nor touched ``$SKY_PROGRESS_FILE``) for
        that many seconds is hung: its stacks go into its log and the gang fails fast; None: off.
        Give the rank tasks and the gang sensor the same value (``sky_gang`` does).
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
        poll_interval: float = 0.5,
        grace: float = 3.0,
        lost_after: float = 10.0,
        orphan_timeout: float | None = DEFAULT_ORPHAN_TIMEOUT,
        idle_down: float | None = None,
        bridge: bool = True,
        bridge_timeout: float | None = None,
        hang_timeout: float | None = None,
        gang_retries: int = 0,
        gang_retry_delay: Any = 0.0,
        gang_retry_exponential_backoff: bool = False,
        retry_on_exit_codes: Any = None,
        **kwargs: Any,
    ) -> None:
        overrides = pop_spec_fields(kwargs)  # before BaseOperator sees (and rejects) them
        check_operator_arguments(self, kwargs, *SPEC_FIELDS, task_id=kwargs.get("task_id"))
        watch = WatchSettings.build(
            sky_conn_id,
            poll_interval,
            grace,
            lost_after,
            hang_timeout,
            orphan_timeout=orphan_timeout,
            idle_down=idle_down,
            bridge_timeout=bridge_timeout,
        )
        policy = operator_policy(
            gang_retries, gang_retry_delay, gang_retry_exponential_backoff, retry_on_exit_codes
        )
        super().__init__(**kwargs)
        refuse_outlets(self)
        #: how the bridge watches the gang (as the rank tasks' triggers do), gang retries included
        self.watch = dataclasses.replace(watch, retry=policy)
        self._init_spec(task_yaml, task_config, overrides)
        self.cluster = cluster
        self.orphan_timeout = orphan_timeout
        self.idle_down = idle_down
        self.bridge = bridge
        self.bridge_timeout = bridge_timeout
        self._launched_here = False
        #: pid of the bridge this task started (None: none), for tests and benchmarks
        self.bridge_pid: int | None = None

    def execute(self, context: Context) -> list[dict[str, Any]]:
        self._launched_here = False
        result = self.execute_resumable(context)
        # on a re-attach the mixin returns poll_until_complete()'s value (None): build the ranks here
        return result if result is not None else self.get_job_result(self._job_id, context)

    def _hook(self) -> SkyHook:
        return SkyHook(self.sky_conn_id)

    def submit_job(self, context: Context) -> str:
        try:
            spec = self.rendered_spec(context)
        except SpecError as exc:  # the task as written cannot run: no retry would change that
            raise AirflowFailException(str(exc)) from None
        ti = context["ti"]
        job_id = job_id_for(ti.dag_id, ti.run_id, ti.task_id, ti.map_index, ti.try_number)
        client = self._hook().client(self.cluster)
        bound = job_cluster(client.handle.name, len(client.handle.nodes))
        if (problem := num_nodes_problem(spec.num_nodes, bound)) is not None:
            raise AirflowFailException(f"{FIELD}: {problem}")
        self.log.info(
            "Starting %s rank(s) of job %s on cluster %s", spec.num_nodes, job_id, client.handle.name
        )
        try:
            if self.bridge and not self._agents_decide(client):
                client.close()  # the bridge launches with its own connections, which it keeps
                bridge = self._start_bridge(job_id, spec)
                self.bridge_pid = bridge.pid
                started = bridge.answer.get("started")
                self.log.info(
                    "Started: %s. The launch-side watcher (pid %s) watches the gang until the triggers "
                    "take over, then exits when the job is over; its log: %s",
                    started,
                    bridge.pid,
                    bridge.log_path,
                )
            else:
                client.keep_secrets = bool(self.retry)  # later attempts start from the nodes' files
                started = client.launch(
                    spec,
                    job_id,
                    orphan_timeout=float(self.orphan_timeout or 0),
                    idle_down=idle_down_for(self.idle_down, spec),
                    grace=float(self.grace),
                    hang_timeout=float(self.hang_timeout or 0),
                    lost_after=float(self.lost_after),
                )
                self.log.info("Started: %s", started)
                if job_id in client.agent_jobs:
                    self.log.info(
                        "The cluster's node agents watch the gang: a failing rank stops its siblings on "
                        "every node from the head node, with or without Airflow"
                    )
                elif self.bridge:  # the head did not take the start after all: watch it from here
                    self._watch_from_here(job_id)
        except LaunchError as exc:
            raise AirflowFailException(f"gang start failed, no rank left running: {exc}") from exc
        except BridgeError:
            self.log.error("The launch-side watcher gave no answer: cancelling whatever it started")
            client.cancel(job_id, grace=1.0, reason="the gang start failed")
            raise
        finally:
            client.close()
        self._launched_here = True
        return job_id

    def _bridge_request(self, job_id: str, spec: TaskSpec | None) -> tuple[BridgeRequest, str | None]:
        """What the bridge needs (the connection's config included: it travels on the bridge's stdin)."""
        kind, config = self._hook().backend_config()
        state_dir: str | None = None
        if kind == "local":
            from airflow_provider_sky.backends.local import default_state_dir

            state_dir = str(config.get("state_dir") or default_state_dir())
            config = {**config, "state_dir": state_dir}
        elif kind == "aws":
            from airflow_provider_sky.hooks.aws import for_another_process

            config = for_another_process(config)  # a linked aws connection's session cannot travel as JSON
        orphan = float(self.orphan_timeout or 0)
        timeout = self.bridge_timeout if self.bridge_timeout is not None else orphan or DEFAULT_ORPHAN_TIMEOUT
        req = BridgeRequest(
            backend=kind,
            config=config,
            cluster=dict(self.cluster),
            job_id=job_id,
            spec=spec.to_dict(include_secrets=True) if spec is not None else None,
            orphan_timeout=orphan,
            idle_down=idle_down_for(self.idle_down, spec),
            poll_interval=float(self.poll_interval),
            grace=float(self.grace),
            lost_after=float(self.lost_after),
            bridge_timeout=float(timeout),
            hang_timeout=self.hang_timeout,
            retry=self.retry,
        )
        return req, state_dir

    def _start_bridge(self, job_id: str, spec: TaskSpec | None) -> Bridge:
        """Start the bridge: it launches the gang when given ``spec``, else it only watches."""
        req, state_dir = self._bridge_request(job_id, spec)
        return start_bridge(req, log_path=log_path_for(state_dir, job_id))

    def get_job_status(self, external_id: Any, context: Context) -> str:
        client = self._hook().client(self.cluster)
        try:
            status = client.peek(str(external_id))
        finally:
            client.close()
        if status.succeeded:
            return "succeeded"
        if (status.failed or status.done) and not self.retry:
            return "failed"
        # running, or attempt 1 over while the watchers retry the gang: they decide its outcome
        return "running"

    def is_job_active(self, status: str) -> bool:
        return status == "running"

    def is_job_succeeded(self, status: str) -> bool:
        return status == "succeeded"

    def poll_until_complete(self, external_id: Any, context: Context) -> None:
        """Nothing to wait for here: the rank tasks and the gang sensor watch the job.

        On a re-attach (a retry after the worker died) a bridge is started to watch the job until the
        triggers take over; if the first attempt's bridge still runs, the new one leaves at once.
        """
        self._job_id = str(external_id)
        if self.bridge and not self._launched_here:
            client = self._hook().client(self.cluster)
            try:
                agents = self._agents_decide(client)
            finally:
                client.close()
            if not agents:
                self._watch_from_here(self._job_id)

    def _agents_decide(self, client: GangClient) -> bool:
        """Whether the cluster's node agents decide the gang's fate (``docs/node-agent.md``): then no
        launch-side watcher is needed, since fail-fast, hang verdicts and the dead-man's switch run on
        the head node. Whole-gang retries need no bridge either: the rank tasks' triggers start each
        next attempt through the head (the attempts' state is on the nodes), whenever they poll."""
        return client.has_agent()

    def _watch_from_here(self, job_id: str) -> None:
        """A bridge that only watches the job (no launch) until the triggers take over; if another
        one already watches it, the new one leaves at once."""
        try:
            bridge = self._start_bridge(job_id, None)
        except (BridgeError, LaunchError) as exc:
            self.log.warning("No launch-side watcher for job %s: %s", job_id, exc)
        else:
            if bridge.answer.get("watching"):
                self.bridge_pid = bridge.pid
                self.log.info("The launch-side watcher (pid %s) watches job %s", bridge.pid, job_id)
            else:
                self.log.info("Job %s is already watched by a launch-side watcher", job_id)

    def get_job_result(self, external_id: Any, context: Context) -> list[dict[str, Any]]:
        # rank tasks started in the triggerer read the job id alone (not the list of every rank)
        context["ti"].xcom_push(key="sky_job_id", value=str(external_id))
        handle = self.cluster
        return [{"rank": i, "job_id": str(external_id), "ip": n["ip"]} for i, n in enumerate(handle["nodes"])]
