"""A SkyPilot job group file as gangs started together and failing together (sky_job_group), under
dag.test() on the local backend."""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any, cast

import pytest
from leaks import job_processes

DAG_FILE = Path(__file__).resolve().parents[1] / "dags" / "sky_test_job_group.py"


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def _run(conf: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    spec = importlib.util.spec_from_file_location("sky_test_job_group", DAG_FILE)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    dr = mod.dag.test(run_conf=conf)
    return dr, {(ti.task_id, ti.map_index): ti for ti in dr.get_task_instances()}


def test_the_tasks_of_a_job_group_run_at_the_same_time(sky_home: Path, tmp_path: Path) -> None:
    """The server waits for the client and the client for the server's rank 1: only tasks running at the
    same time meet. Every task has SKYPILOT_JOBGROUP_NAME."""
    meet = tmp_path / "meet"
    meet.mkdir()
    dr, tis = _run({"RENDEZVOUS": str(meet), "SERVER_EXIT": "0"})
    assert str(dr.state) == "success"
    assert tis[("pair.server.gang", -1)].state == "success"
    assert tis[("pair.client.gang", -1)].state == "success"
    assert tis[("pair.stop_together", -1)].state == "skipped"
    assert (meet / "server-0").read_text() == "pair\n"
    assert not list((sky_home / "local").glob("sky-*")), "a cluster of the group is left"


class _RunXComs:
    """What the stop task reads of its run: the cluster tasks' handles and the job tasks' job ids (the
    values sky_gang's tasks push), served as ``ti.xcom_pull`` serves them."""

    def __init__(self, values: dict[tuple[str, str], Any]) -> None:
        self.values = values

    def xcom_pull(self, task_ids: str, key: str = "return_value") -> Any:
        return self.values.get((task_ids, key))


def test_one_failing_task_stops_the_others(sky_home: Path) -> None:
    """The stop task (run by Airflow once one gang's sensor failed; dag.test() runs one trigger at a time,
    so the gangs' watches cannot overlap there) cancels the job of every gang still running: the client
    that would sleep for hours ends cancelled, its processes gone, and the task fails naming the group."""
    from airflow.sdk.exceptions import AirflowFailException
    from gangs import wait_done

    from airflow_provider_sky.hooks.sky import SkyHook
    from airflow_provider_sky.operators.jobgroup import SkyJobGroupStopOperator
    from airflow_provider_sky.spec import task_from_args

    hook = SkyHook()
    server, client = task_from_args(run="exit 3"), task_from_args(num_nodes=2, run="sleep 10000")
    hs, hc = hook.provision("grp-server", server), hook.provision("grp-client", client)
    try:
        hook.client(hs).launch(server, "job-s")
        hook.client(hc).launch(client, "job-c")
        assert wait_done(hook.client(hs), "job-s").status.ranks[0].state == "failed"
        stop = SkyJobGroupStopOperator(
            task_id="stop_together",
            group_name="pair",
            gangs=[
                ("server", "s.cluster", "s.job"),
                ("client", "c.cluster", "c.job"),
                ("idle", "i.cluster", "i.job"),
            ],
        )
        xcoms = _RunXComs(
            {
                ("s.cluster", "return_value"): hs.to_dict(),
                ("s.job", "sky_job_id"): "job-s",
                ("c.cluster", "return_value"): hc.to_dict(),
                ("c.job", "sky_job_id"): "job-c",
            }
        )
        t = time.monotonic()
        with pytest.raises(
            AirflowFailException, match=r"job group pair: .*stopped the jobs of: server, client$"
        ):
            stop.execute(cast("Any", {"ti": xcoms}))
        poll = wait_done(hook.client(hc), "job-c", timeout=15)
        assert [r.state for r in poll.status.ranks] == ["cancelled", "cancelled"]
        assert time.monotonic() - t < 15  # the grace (3 s) and a poll, not the sleep
        assert poll.status.cancel_reason == "job group pair: another task of the group failed"
        assert not job_processes(sky_home), "the client's sleep outlived the group"
    finally:
        hook.teardown("grp-server", force=True)
        hook.teardown("grp-client", force=True)


def test_auxiliary_tasks_end_as_succeeded_once_the_primary_tasks_are_done(sky_home: Path) -> None:
    """``primary_tasks``: an auxiliary server that would serve for hours is told to end (the end task,
    run once every primary gang succeeded); after its ``termination_delay`` its processes are gone and
    its ranks succeeded."""
    from gangs import wait_done

    from airflow_provider_sky.hooks.sky import SkyHook
    from airflow_provider_sky.operators.jobgroup import (
        STOP_ENV,
        SkyJobGroupEndOperator,
        auxiliary_run,
        stop_path,
    )
    from airflow_provider_sky.spec import task_from_args

    hook = SkyHook()
    run = 'echo "serving on $SKYPILOT_NODE_RANK"\nsleep 10000\necho "not reached"\n'
    aux = task_from_args(num_nodes=2, run=auxiliary_run(run), envs={STOP_ENV: stop_path("pair", "run-1")})
    h = hook.provision("grp-aux", aux)
    try:
        client = hook.client(h)
        client.launch(aux, "job-a")
        time.sleep(1.5)
        assert [r.state for r in client.poll("job-a").status.ranks] == ["running", "running"]
        end = SkyJobGroupEndOperator(
            task_id="end_auxiliaries", group_name="pair", gangs=[("server", "a.cluster", 1.0)]
        )
        t = time.monotonic()
        end.execute(
            cast("Any", {"ti": _RunXComs({("a.cluster", "return_value"): h.to_dict()}), "run_id": "run-1"})
        )
        poll = wait_done(hook.client(h), "job-a", timeout=20)
        took = time.monotonic() - t
        assert [r.state for r in poll.status.ranks] == ["succeeded", "succeeded"], poll.status
        assert 1.0 <= took < 15, took  # the delay written (1 s), then the next check (1 s) and a poll
        assert not job_processes(sky_home), "the auxiliary's sleep outlived its end"
    finally:
        hook.teardown("grp-aux", force=True)
