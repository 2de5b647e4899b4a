"""Whole-gang retries under dag.test() on the local backend: real processes, real Airflow."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from k8s_cluster import wait_for
from leaks import bridges, job_processes

from integration.test_dag_test import _load, _out, _run, _states, _xcom

#: dag.test() needs the metadata DB (migrated once per session), whichever module runs first
pytestmark = pytest.mark.usefixtures("airflow_db")


def _run_dag(name: str) -> tuple[Any, dict[tuple[str, int], Any]]:
    """dag.test() of one DAG of tests/dags/sky_test_retry.py (two DAGs in one file)."""
    dag = getattr(_load("sky_test_retry", folder="tests/dags"), name)
    dr = dag.test()
    return dr, {(ti.task_id.split(".", 1)[1], ti.map_index): ti for ti in dr.get_task_instances()}


def test_sky_retry_fails_once_then_succeeds_on_attempt_2(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    dr, tis = _run("sky_retry")
    out = _out(capfd)
    assert str(dr.state) == "success", out[-5000:]
    assert _states(tis, "rank") == {0: "success", 1: "success", 2: "success", 3: "success"}
    assert tis[("gang", -1)].state == "success" and tis[("down", -1)].state == "success"
    job_ids = set(re.findall(r"attempt \d of job (\S+)", out))
    assert len(job_ids) == 1, job_ids  # SKYPILOT_TASK_ID is the same in both attempts
    # attempt 2 started after every process of attempt 1 was gone: each rank of attempt 2 looked
    assert out.count("processes of attempt 1 still alive: 0") >= 4, out[-5000:]
    assert "==== attempt 2/3: rank 2 exited 1, retryable by retry_on_exit_codes ====" in out
    # the gang's result is rank 0's last line of the attempt that succeeded (attempt 1's was its first)
    assert _xcom(dr, "train.gang", "return_value") == "processes of attempt 1 still alive: 0"
    for r in range(4):
        summary = _xcom(dr, "train.rank", "sky_rank", r)
        assert summary["state"] == "succeeded" and summary["attempt"] == 2, summary
        first, second = summary["attempts"]
        assert first["attempt"] == 1 and second["attempt"] == 2 and second["state"] == "succeeded", summary
        assert first["state"] == ("failed" if r == 2 else "cancelled"), summary
        assert second["start"] > first["end"], summary  # the attempts never overlap
    assert not job_processes(sky_home) and not bridges(sky_home)


def test_retries_exhausted_lists_every_attempt(sky_home: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dr, tis = _run_dag("exhausted")
    out = _out(capfd)
    assert str(dr.state) == "failed"
    assert _states(tis, "rank") == {0: "failed", 1: "failed"}
    summary = _xcom(dr, "train.rank", "sky_rank", 1)
    assert [a["attempt"] for a in summary["attempts"]] == [1, 2, 3], summary
    assert all(a["state"] == "failed" and a["exit_code"] == 3 for a in summary["attempts"]), summary
    assert re.search(
        r"failed: rank 1 \(\S+\) exited with code 3; rank 0 cancelled\. Return code list: \['cancelled', 3\] "
        r"\(attempt 3/3\); not retried: no retry left \(retries=2\); "
        r"attempt 1: .*exited with code 3.* -> rank 1 exited 3, retryable by retry_on_exit_codes; "
        r"attempt 2: .* -> rank 1 exited 3, retryable",
        out,
    ), out[-5000:]


def test_a_deterministic_exit_code_is_not_retried(sky_home: Path, capfd: pytest.CaptureFixture[str]) -> None:
    dr, tis = _run_dag("not_retryable")
    out = _out(capfd)
    assert str(dr.state) == "failed"
    summary = _xcom(dr, "train.rank", "sky_rank", 1)
    assert summary["exit_code"] == 127 and "attempts" not in summary, summary
    assert "attempt 2" not in out
    # every rank task's error says why the gang was not run again
    assert (
        "not retried: rank 1 exited 127 (command not found), not retryable: it fails the same way every "
        "time (list 127 in retry_on_exit_codes to retry it)"
    ) in out, out[-3000:]


def _watch_to_end(client: Any, policy: Any, on_poll: Any = None, timeout: float = 60.0) -> Any:
    """Run the attempts loop (as the triggers' shared poll does) to its final poll."""
    import asyncio

    from airflow_provider_sky.watch.retry import watch_attempts

    async def go() -> Any:
        last = None
        async for poll in watch_attempts(client, "job", policy=policy, poll_interval=0.1):
            last = poll
            if on_poll is not None:
                await on_poll(poll)
        return last

    return asyncio.run(asyncio.wait_for(go(), timeout))


def test_a_user_stop_during_the_retry_delay_starts_no_further_attempt(sky_home: Path) -> None:
    """What a mark-failed does (the trigger's on_kill calls stop_gang): no attempt 2, nothing left running."""
    from gangs import local_gang

    from airflow_provider_sky.watch.retry import RetryPolicy, stop_gang

    run = 'if [ "$SKYPILOT_NODE_RANK" == "1" ]; then sleep 0.3; exit 1; fi; sleep 1000'
    backend, client, task = local_gang(sky_home, 3, run)
    client.keep_secrets = True
    client.launch(task, "job")
    policy = RetryPolicy.build(retries=2, retry_delay=2, retry_on_exit_codes=[1])
    stopped: list[float] = []

    async def stop_once(poll: Any) -> None:
        if poll.status.done and not poll.final and not stopped:  # attempt 1 over, the retry delay runs
            stopped.append(time.time())
            await stop_gang(client, "job", policy.attempts, 1.0, "a user marked rank task 0 failed")

    final = _watch_to_end(client, policy, stop_once)
    assert stopped and final.final and final.attempt == 1
    assert "attempt 2 not started: a user stopped the gang" in final.message(), final.message()
    assert not list(sky_home.glob("local/**/jobs/job.a2/*/pid"))  # attempt 2 never started
    assert not job_processes(sky_home)
    backend.terminate(client.handle.name)


def test_a_hang_is_retried_and_the_next_attempt_succeeds(sky_home: Path) -> None:
    """Hangs are retryable by default: attempt 1 hangs (silent), attempt 2 prints and ends."""
    from gangs import local_gang

    from airflow_provider_sky.watch.retry import RetryPolicy, watch_attempts

    run = 'if [ "$SKY_ATTEMPT" == "1" ]; then sleep 1000; fi; echo "attempt $SKY_ATTEMPT done"'
    backend, client, task = local_gang(sky_home, 2, run)
    client.launch(task, "job")
    policy = RetryPolicy.build(retries=1)

    import asyncio

    async def go() -> Any:
        last = None
        async for poll in watch_attempts(client, "job", policy=policy, poll_interval=0.1, hang_timeout=1.5):
            last = poll
        return last

    final = asyncio.run(asyncio.wait_for(go(), 60))
    assert final.final and final.attempt == 2 and final.status.succeeded, final.message()
    # both ranks hang together: either may be the one named first
    assert re.fullmatch(
        r"rank [01] hung: no output for 1\.5 s \(ranks 0, 1\), retryable \(hangs are retried\)",
        final.history[0]["why"],
    ), final.history[0]["why"]
    assert not job_processes(sky_home)
    backend.terminate(client.handle.name)


def test_a_retried_gang_pushes_the_successful_attempts_result(sky_home: Path) -> None:
    """Attempt 1 wrote a result file before rank 1 failed; the result is attempt 2's file, every rank's."""
    dag = _load("sky_test_retry_result", folder="tests/dags").dag
    dr = dag.test()
    assert str(dr.state) == "success"
    assert _xcom(dr, "train.gang", "return_value") == [{"attempt": 2}, {"attempt": 2}]
    assert not job_processes(sky_home) and not bridges(sky_home)


#: attempt 1's rank 1 fails at once; every rank of a later attempt checks its secret and says so
_SIBLING_RUN = (
    'if [ "$SKY_ATTEMPT" = 1 ] && [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 1; fi; '
    'if [ "${TOK#tok-}" = value-77 ]; then echo "rank $SKYPILOT_NODE_RANK attempt $SKY_ATTEMPT has its secret"; '
    "else exit 9; fi"
)


def _never_started_dirs(sky_home: Path, job: str = "job") -> dict[int, Path]:
    """Rank -> its attempt-1 directory, for the ranks recorded cancelled without having run."""
    out = {}
    for cancel in sky_home.glob(f"local/**/jobs/{job}/*/cancel"):
        d = cancel.parent
        if not (d / "pid").exists():
            out[int(d.name)] = d
    return out


def test_ranks_never_started_because_a_sibling_failed_first_run_in_the_next_attempt(
    sky_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a slow cluster a rank can fail before its siblings' start calls ran: those siblings are
    recorded cancelled without having run (by their machine's launcher, or by the launch side), and the
    whole-gang retry must still start every rank of attempt 2, with its secrets. Here rank 1's call goes
    first and the others wait until it has failed, as when its node answers long before theirs."""
    import asyncio

    from gangs import local_gang

    from airflow_provider_sky.watch import jobs
    from airflow_provider_sky.watch.retry import RetryPolicy

    backend, client, task = local_gang(sky_home, 4, _SIBLING_RUN, secrets={"TOK": "tok-value-77"})
    client.keep_secrets = True
    monkeypatch.setattr(jobs, "LAUNCH_RANKS", 1)  # one start call per rank
    exit_1 = Path(client.handle.nodes[1].root) / "jobs" / "job" / "1" / "exit"
    for node in client.handle.nodes[:1] + client.handle.nodes[2:]:
        runner = client.runner(node)
        real = runner.arun_script

        async def after_rank_1(*a: Any, _real: Any = real, **kw: Any) -> Any:
            if "cmd.sh" in a[0]:  # a start call: once rank 1 has failed
                for _ in range(200):
                    if exit_1.exists() and exit_1.read_text().strip():
                        break
                    await asyncio.sleep(0.05)
            return await _real(*a, **kw)

        monkeypatch.setattr(runner, "arun_script", after_rank_1)
    client.launch(task, "job")
    monkeypatch.undo()
    assert sorted(_never_started_dirs(sky_home)) == [0, 2, 3]
    final = _watch_to_end(client, RetryPolicy.build(retries=1, retry_delay=0.1, retry_on_exit_codes=[1]))
    assert final.final and final.attempt == 2 and final.status.succeeded, final.message()
    logs = "".join(p.read_text() for p in sky_home.glob("local/**/jobs/job.a2/*/log"))
    for r in range(4):
        assert f"rank {r} attempt 2 has its secret" in logs, logs
    # nothing of the secret stayed on disk: attempt 1's never-started ranks kept none once the gang ended
    assert not [
        p for p in sky_home.glob("local/**/jobs/**/*") if p.is_file() and b"tok-value-77" in p.read_bytes()
    ]
    # a wrapper ends a moment after its exit record (its output filter's watchdog with it)
    wait_for(lambda: not job_processes(sky_home), 10, "the wrappers to end after their exit records")
    backend.terminate(client.handle.name)


def test_ranks_the_launch_side_recorded_never_started_run_in_the_next_attempt(sky_home: Path) -> None:
    """The launch side's own record of ranks it did not start (a sibling failed before their call)
    keeps what a later attempt needs to start them."""
    from gangs import local_gang

    from airflow_provider_sky.aio import run_sync
    from airflow_provider_sky.watch.retry import RetryPolicy

    backend, client, task = local_gang(sky_home, 3, _SIBLING_RUN, secrets={"TOK": "tok-value-77"})
    client.keep_secrets = True
    launches = {rl.rank: rl for rl in client.rank_launches(task, "job", "run")}
    recorded = run_sync(client._record_never_started("job", [0, 2], "rank 1 failed first", launches))
    assert recorded == {0: "CANCELLED", 2: "CANCELLED"}
    assert client.launch(task, "job") == {0: "EXISTS", 1: "STARTED", 2: "EXISTS"}
    assert not [p for p in sky_home.glob("local/**/jobs/job/*/secrets") if p.exists()]
    final = _watch_to_end(client, RetryPolicy.build(retries=1, retry_delay=0.1, retry_on_exit_codes=[1]))
    assert final.final and final.attempt == 2 and final.status.succeeded, final.message()
    logs = "".join(p.read_text() for p in sky_home.glob("local/**/jobs/job.a2/*/log"))
    assert all(f"rank {r} attempt 2 has its secret" in logs for r in range(3)), logs
    wait_for(lambda: not job_processes(sky_home), 10, "the wrappers to end after their exit records")
    backend.terminate(client.handle.name)
