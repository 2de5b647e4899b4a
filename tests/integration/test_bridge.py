"""The launch-side watcher (bridge) on the local backend, with no trigger running: real processes only.

Nothing watched a gang between the job task's end and the triggers' first poll, so
a rank failing at once had its siblings killed seconds late. The job task now launches through a
detached bridge that watches until the triggers' shared poll takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
from gangs import rank_exit
from leaks import bridges, job_processes
from siblings import LastAlive, matching

from airflow_provider_sky.backends.base import ClusterHandle
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.spec import TaskSpec, task_from_args
from airflow_provider_sky.watch import bridge as bridge_mod
from airflow_provider_sky.watch.bridge import Bridge, BridgeRequest, bridge_watch, log_path_for, start_bridge
from airflow_provider_sky.watch.jobs import GangClient, Poll
from airflow_provider_sky.watch.loop import watch

AT_ONCE = 'if [ "$SKYPILOT_NODE_RANK" = "2" ]; then exit 1; fi\nsleep 10000\n'


def _gang(sky_home: Path, name: str, run: str, n: int = 4) -> tuple[LocalBackend, ClusterHandle, TaskSpec]:
    backend = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=n, run=run)
    return backend, backend.provision(name, spec), spec


def _rank_exit(handle: ClusterHandle, job_id: str, rank: int) -> tuple[str, float]:
    """The rank's exit code and end time (``("", 0.0)`` before it exited)."""
    return rank_exit(_rank_dir(handle, job_id, rank)) or ("", 0.0)


def _rank_dir(handle: ClusterHandle, job_id: str, rank: int) -> Path:
    return Path(handle.nodes[rank].root) / "jobs" / job_id / str(rank)


def _wait_exit(b: Bridge, timeout: float) -> float:
    """Wait for the bridge process to end; returns when (wall time)."""
    deadline = time.monotonic() + timeout
    while b.proc.poll() is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"the bridge (pid {b.pid}) still runs after {timeout:.0f}s")
        time.sleep(0.02)
    return time.time()


def _request(
    sky_home: Path, handle: ClusterHandle, job_id: str, spec: TaskSpec | None, **kw: Any
) -> BridgeRequest:
    return BridgeRequest(
        "local",
        {"state_dir": str(sky_home)},
        handle.to_dict(),
        job_id,
        spec=spec.to_dict(include_secrets=True) if spec is not None else None,
        **kw,
    )


class _TI:
    dag_id, run_id, task_id, map_index, try_number = "bridge_dag", "run1", "job", -1, 1
    stats_tags: dict[str, str] = {}
    pushed: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.pushed[key] = value


#: the launch's own line when it saw the failure itself (the machine's gang-start flag or its start watch)
BY_LAUNCH = "failed during the gang start: rank 2 failed first"
BY_BRIDGE = "Rank failed; cancelling ranks [0, 1, 3]"
#: the machine cancelled its ranks itself (every local rank is on one machine): the bridge only watched
BY_NODE = "ends: done"
#: rank 2 takes its machine's list of ranks away before failing, as if every rank were on a machine of
#: its own (SSH hosts, pods): the machine cannot stop the others, the bridge must
NO_NODE_LIST = (
    'j=${SKY_PROGRESS_FILE%/*}; j=${j%/*}; rm -f "$(printf %s "$j" | sed "s|/node-2/|/node-0/|")/.ranks"; '
)


@pytest.mark.parametrize(
    ("run", "cancelled_by"),
    [
        # failing at once: the launch itself usually sees it (the machine or the bridge when the start
        # was done first)
        (AT_ONCE, (BY_LAUNCH, BY_NODE, BY_BRIDGE)),
        # failing once the start is over, on the machine of its siblings: that machine stops them
        (AT_ONCE.replace("exit 1", "sleep 2; exit 1"), (BY_NODE,)),
        # failing once the start is over, where the machine cannot: the bridge, before any trigger runs
        (AT_ONCE.replace("exit 1", f"sleep 2; {NO_NODE_LIST}exit 1"), (BY_BRIDGE,)),
    ],
    ids=["at-once", "after-the-start", "after-the-start-other-machines"],
)
def test_a_failing_rank_is_cancelled_by_the_job_tasks_own_code(
    sky_home: Path, run: str, cancelled_by: tuple[str, ...]
) -> None:
    """The seed scenario started by the job task's own code, no trigger: siblings gone < 1 s after the exit."""
    from airflow_provider_sky.model.gang import job_id_for
    from airflow_provider_sky.operators.job import SkyJobOperator

    backend, handle, spec = _gang(sky_home, "once", run)
    job_id = job_id_for(_TI.dag_id, _TI.run_id, _TI.task_id, -1, 1)
    op = SkyJobOperator(task_id="job", cluster=handle.to_dict(), num_nodes=4, run=run, sky_conn_id=None)
    with LastAlive(f"SKYPILOT_TASK_ID={job_id}", tick=0.01) as siblings:
        ranks = op.execute({"ti": _TI(), "task_state_store": None})
        assert [r["job_id"] for r in ranks] == [job_id] * 4
        # one bridge at most: it may be gone already (rank 2 fails at once, the machine stops its
        # siblings within milliseconds, and the bridge ends with the job); its log below shows it ran
        assert len(bridges(sky_home)) <= 1
        deadline = time.monotonic() + 10
        while bridges(sky_home) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not bridges(sky_home), "the bridge did not exit once the job was over"
    code2, end2 = _rank_exit(handle, job_id, 2)
    assert code2 == "1"
    sibling_ends = [_rank_exit(handle, job_id, r)[1] for r in (0, 1, 3)]
    gone = (siblings.last_alive or end2) - end2
    print(
        f"\nexit -> last sibling seen alive {gone:.3f}s, -> last sibling's end {max(sibling_ends) - end2:.3f}s"
    )
    assert gone < 1.0, f"a sibling still ran {gone:.2f}s after rank 2 exited"
    assert max(sibling_ends) - end2 < 1.0
    assert not matching(f"SKYPILOT_TASK_ID={job_id}")
    log = (sky_home / "bridge" / f"{job_id}.log").read_text()
    assert any(line in log for line in cancelled_by) and "ends: done" in log, log
    backend.terminate("once")


def test_the_bridge_steps_back_while_a_marking_watcher_polls_and_exits_with_the_job(sky_home: Path) -> None:
    """In-process: count the bridge's calls while the triggers' (marking) shared poll runs beside it."""
    # 7 s: at least 2 s of steady polling between the first mark + 1.5 s and the end - 1 s, also when
    # the launch and the first mark are slow
    backend, handle, spec = _gang(sky_home, "steady", "sleep 7")
    job_id = "steady-1"
    calls: list[tuple[float, int]] = []

    class Counting(bridge_mod._QuietClient):
        async def apoll(self, job_id: str, *args: Any, **kwargs: Any) -> Poll:
            ranks = kwargs.get("ranks")
            calls.append((time.monotonic(), self.num_ranks if ranks is None else len(ranks)))
            return await super().apoll(job_id, *args, **kwargs)

    async def go() -> tuple[str, float, float, float, float]:
        quiet = Counting(backend, handle)
        trig = GangClient(backend, handle)
        try:
            await quiet.alaunch(spec, job_id)
            t0 = time.monotonic()
            # the marks stale after 1.5 s (6 intervals, not the default 2): on a machine at a load
            # average of 10 the marking poll, a fork per call, was once 0.5 s late, and the bridge then
            # rightly took it for a lapse
            bridged = bridge_watch(quiet, job_id, poll_interval=0.25, bridge_timeout=60, stale_after=1.5)
            task = asyncio.create_task(bridged)
            await asyncio.sleep(1.0)  # the bridge alone: every node, every interval
            joined = time.monotonic()
            marked = 0.0
            async for poll in watch(trig, job_id, poll_interval=0.25):  # marks, as the triggers do
                last = poll
                marked = marked or time.monotonic()  # its first poll has left its mark on every rank
            ended = time.monotonic()
            assert last.status.succeeded
            outcome = await asyncio.wait_for(task, 10)
            return outcome, t0, joined, marked, ended
        finally:
            quiet.close()
            trig.close()

    outcome, t0, joined, marked, ended = asyncio.run(go())
    assert outcome == "done"
    alone = [n for t, n in calls if t0 <= t < joined]
    assert alone and all(n == 4 for n in alone) and len(alone) >= 3, alone
    # 1.5 s after the marking poll's first mark (6 of the bridge's intervals: it reads the marks at
    # each poll), the bridge asks one node, twice per interval (until the ranks end: a rank over makes
    # it look at every rank). Counted from the mark, not from the watcher's start: at a load average
    # of 10 the bridge still asked every node more than a second after the watcher started.
    # Up to the first rank's end (its exit record, on this machine's clock; 0.1 s for the record's
    # centiseconds and the clocks' offset), not the watcher's: under load the watcher can see the end
    # more than a second after the bridge, which then asks every rank, as it should.
    off = time.time() - time.monotonic()
    first_end = min(_rank_exit(handle, job_id, r)[1] for r in range(4)) - off
    beside = [n for t, n in calls if marked + 1.5 <= t < min(ended - 1.0, first_end - 0.1)]
    assert beside and all(n == 1 for n in beside), (first_end, calls)
    assert len(beside) <= 2 * (ended - joined) / 0.25 + 2  # two cheap calls per interval
    # it noticed the job's end within a couple of intervals
    assert calls[-1][0] - ended < 1.5, (calls[-1][0] - ended, calls)
    backend.terminate("steady")


def test_the_bridge_process_hands_over_resumes_when_the_marks_stop_and_exits(sky_home: Path) -> None:
    """A marking watcher polls for 2 s, then stops (a triggerer restart); rank 2 fails later: the bridge acts."""
    run = 'if [ "$SKYPILOT_NODE_RANK" = "2" ]; then sleep 4; exit 1; fi\nsleep 10000\n'
    backend, handle, spec = _gang(sky_home, "lapse", run)
    job_id = "lapse-1"
    b = start_bridge(_request(sky_home, handle, job_id, spec), log_path=log_path_for(sky_home, job_id))
    assert b.answer["started"] == {str(r): "STARTED" for r in range(4)}

    async def mark_for(seconds: float) -> None:
        client = GangClient(backend, handle)
        try:
            deadline = time.monotonic() + seconds
            async for _ in watch(client, job_id, poll_interval=0.5):
                if time.monotonic() > deadline:
                    return
        finally:
            client.close()

    with LastAlive(f"SKYPILOT_TASK_ID={job_id}", tick=0.01) as siblings:
        asyncio.run(mark_for(2.0))
        gone_at = _wait_exit(b, 15)
    end2 = _rank_exit(handle, job_id, 2)[1]
    gone = (siblings.last_alive or end2) - end2
    log = b.log_path.read_text() if b.log_path else ""
    assert "stepping back" in log and "watching every rank again" in log, log
    assert "ends: done" in log, log
    assert gone < 1.0, f"siblings ran {gone:.2f}s after rank 2 exited (no watcher but the bridge): {log}"
    assert gone_at - end2 < 3.0
    backend.terminate("lapse")


def test_the_bridge_leaves_after_bridge_timeout_when_nobody_takes_over(sky_home: Path) -> None:
    """Nothing fails and no other watcher ever comes: the bridge exits after bridge_timeout, the ranks run on."""
    backend, handle, spec = _gang(sky_home, "alone", "sleep 10000", n=2)
    job_id = "alone-1"
    t = time.time()
    b = start_bridge(
        _request(sky_home, handle, job_id, spec, bridge_timeout=2.0), log_path=log_path_for(sky_home, job_id)
    )
    left = _wait_exit(b, 15) - t
    assert 2.0 <= left < 6.0, left
    assert "No other watcher of job alone-1 for 2s" in (b.log_path.read_text() if b.log_path else "")
    assert (
        len(matching(f"SKYPILOT_TASK_ID={job_id}")) == 2
    )  # it leaves the job to the nodes' dead-man's switch
    backend.terminate("alone")


def test_the_bridge_never_keeps_an_abandoned_job_alive(sky_home: Path) -> None:
    """Its polls leave no mark: with orphan_timeout=2 the nodes kill the job although the bridge polls."""
    backend, handle, spec = _gang(sky_home, "orphan", "sleep 10000", n=2)
    job_id = "orphan-1"
    t = time.time()
    b = start_bridge(
        _request(sky_home, handle, job_id, spec, orphan_timeout=2.0), log_path=log_path_for(sky_home, job_id)
    )
    _wait_exit(b, 20)
    assert time.time() - t < 10
    assert not matching(f"SKYPILOT_TASK_ID={job_id}")
    assert (_rank_dir(handle, job_id, 0) / "orphaned").exists()
    log = b.log_path.read_text() if b.log_path else ""
    assert "ends: done" in log, log
    backend.terminate("orphan")


def test_a_second_bridge_of_a_job_leaves_at_once(sky_home: Path) -> None:
    """A retried job task re-attaches and starts a watch-only bridge; the first one still watches."""
    backend, handle, spec = _gang(sky_home, "twice", "sleep 3", n=2)
    job_id = "twice-1"
    first = start_bridge(_request(sky_home, handle, job_id, spec), log_path=log_path_for(sky_home, job_id))
    second = start_bridge(_request(sky_home, handle, job_id, None), log_path=log_path_for(sky_home, job_id))
    assert second.answer["watching"] is False
    _wait_exit(second, 5)
    assert first.proc.poll() is None
    _wait_exit(first, 10)
    backend.terminate("twice")


def test_no_secret_on_the_bridge_command_line_environment_or_log(
    sky_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = "-----BEGIN OPENSSH PRIVATE KEY-----\nSECRET-KEY-TEXT-41\n-----END OPENSSH PRIVATE KEY-----"
    monkeypatch.setenv("AIRFLOW_CONN_OTHER", "sky-ssh://u:CONN-SECRET-42@h")
    monkeypatch.setenv("AIRFLOW__CORE__FERNET_KEY", "FERNET-SECRET-43")
    backend = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=2, run="sleep 2", secrets={"TOKEN": "RANK-SECRET-44"})
    handle = backend.provision("sec", spec)
    req = BridgeRequest(
        "local",
        {"state_dir": str(sky_home), "password": key},
        handle.to_dict(),
        "sec-1",
        spec=spec.to_dict(include_secrets=True),
    )
    b = start_bridge(req, log_path=log_path_for(sky_home, "sec-1"))
    cmdline = Path(f"/proc/{b.pid}/cmdline").read_bytes()
    environ = Path(f"/proc/{b.pid}/environ").read_bytes()
    assert cmdline.split(b"\0")[1:3] == [b"-m", b"airflow_provider_sky.watch.bridge"]
    assert str(sky_home).encode() not in cmdline
    assert Path(os.readlink(f"/proc/{b.pid}/cwd")) == Path("/")
    _wait_exit(b, 10)
    log = b.log_path.read_bytes() if b.log_path else b""
    for secret in (b"SECRET-KEY-TEXT-41", b"CONN-SECRET-42", b"FERNET-SECRET-43", b"RANK-SECRET-44"):
        assert secret not in cmdline and secret not in environ and secret not in log, secret
    with contextlib.suppress(Exception):
        backend.terminate("sec")
    # a rank's wrapper stops its mask filter's watchdog (a `sleep`) before it writes its exit, but the
    # watchdog ends asynchronously: on a loaded machine it can still be there when the bridge has seen
    # every exit (1 run in ~10); it ends within moments by itself
    deadline = time.monotonic() + 5
    while job_processes(sky_home) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not job_processes(sky_home)


def test_a_launch_failure_is_reported_by_the_bridge(sky_home: Path) -> None:
    """A rank that cannot start fails the launch; the bridge answers with the error and leaves nothing."""
    backend, handle, spec = _gang(sky_home, "bad", "sleep 10000", n=2)
    job_id = "bad-1"
    bad = ClusterHandle.from_dict(
        {
            **handle.to_dict(),
            "nodes": [
                handle.to_dict()["nodes"][0],
                {**handle.to_dict()["nodes"][1], "root": "/proc/nonexistent-sky/.sky"},
            ],
        }
    )
    from airflow_provider_sky.watch.jobs import LaunchError

    with pytest.raises(LaunchError, match="nonexistent-sky"):
        start_bridge(_request(sky_home, bad, job_id, spec), log_path=log_path_for(sky_home, job_id))
    deadline = time.monotonic() + 5
    while bridges(sky_home) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not bridges(sky_home)
    assert not matching(f"SKYPILOT_TASK_ID={job_id}")
    backend.terminate("bad")


def test_handover_needs_a_steady_watcher_and_notices_a_lapse() -> None:
    """The step-back rule on its own: two advances of the marks within the limit; stale after it."""
    from airflow_provider_sky.model.gang import RankStatus
    from airflow_provider_sky.watch.bridge import Handover

    now = [100.0]
    hand = Handover(stale_after=1.0, clock=lambda: now[0])

    def seen(*marks: float | None) -> None:
        hand.observe(RankStatus(r, "ip", "running", polled_at=m) for r, m in enumerate(marks))

    seen(50.0, 50.001)  # the launch's own marks: the baseline
    assert not hand.active()
    now[0] += 0.5
    seen(50.0, 50.001)
    assert not hand.active()
    seen(60.0, 60.0)  # a one-off look (e.g. a rank task starting) is not a watcher
    now[0] += 3.0
    assert not hand.active()
    for k in range(4):  # a shared poll every 0.5 s (its clock is 10 s off ours: no matter)
        now[0] += 0.5
        seen(70.0 + 0.5 * k, 70.0 + 0.5 * k + 0.001)
    assert hand.active()
    now[0] += 0.25
    seen(71.5)  # one rank only (the cheap check), no new poll yet: still active
    assert hand.active()
    seen(71.5, 71.4, 71.45)  # older marks of other ranks (seen again on a full poll) are no change
    assert hand.changes[-1] == now[0] - 0.25
    now[0] += 1.1  # no advance for longer than the limit: stale
    assert not hand.active()
    # a slow watcher (a poll of many nodes takes 1.2 s) is not taken for a lapse
    for k in range(3):
        now[0] += 1.2
        seen(80.0 + 1.2 * k)
    now[0] += 1.5
    assert hand.limit == pytest.approx(1.8) and hand.active()
