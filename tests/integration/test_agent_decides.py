"""With node agents the gang's fate is decided on its head node, the watchers' parts included: a hung
rank is found, dumped and the gang failed by the head's agent with nothing polling, and a whole-gang
retry's next attempt is started through the head, which then fails it fast as it did the first.
Real agent processes on the local backend (``node_agent: true``); the code is the SSH hosts' and the
pods' (``backends/nodeagents.py``, ``agent/node.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from leaks import job_processes

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.model.gang import GangStatus
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.retry import RetryPolicy, watch_attempts

pytestmark = pytest.mark.cluster_lane  # see setup.cfg

#: seconds past the expected moment before a test gives up waiting for the ranks' own exit records
#: (the head checks every second; the dump and the cancel's grace take seconds on a loaded machine)
MARGIN = 15.0


def _ended(b: LocalBackend, handle_nodes: list, job: str, ranks: range, timeout: float) -> bool:
    """Whether every rank wrote its exit record, read from the node directories (no status call)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(Path(handle_nodes[r].root, "jobs", job, str(r), "exit").exists() for r in ranks):
            return True
        time.sleep(0.1)
    return False


def _settled(c: GangClient, job: str, timeout: float = MARGIN) -> tuple[GangStatus, int]:
    """The head's answer once every rank in it has ended, and the looks that took: the ranks' exit
    records are on the nodes first, the head hears of them with its nodes' next heartbeat."""
    deadline = time.monotonic() + timeout
    looks = 1
    while not (status := c.peek(job)).done and time.monotonic() < deadline:
        time.sleep(0.2)
        looks += 1
    return status, looks


def test_the_head_finds_a_hung_rank_dumps_its_stack_and_fails_the_gang_with_nothing_polling(
    sky_home: Path,
) -> None:
    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("hg", task_from_args(num_nodes=3, run="true"))
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then echo started; exec sleep 10000; fi; '
        "while true; do echo tick; sleep 0.3; done"
    )
    try:
        c = GangClient(b, h)
        c.launch(task_from_args(num_nodes=3, run=run), "hj", hang_timeout=2.0)
        assert (c.agent_calls, c.node_calls) == (1, 0)
        # nothing polls: the head times rank 1's silence from the heartbeats, dumps, then cancels
        assert _ended(b, h.nodes, "hj", range(3), 2.0 + MARGIN), job_processes(sky_home)
        status, looks = _settled(c, "hj")
        assert (c.agent_calls, c.node_calls) == (1 + looks, 0)  # the launch, then the looks: at the head
        hung = "hung: no output for 2 s (rank 1)"
        states = {r.rank: (r.state.value, r.reason) for r in status.ranks}
        assert states[1] == ("failed", hung), states
        assert states[0] == ("cancelled", f"cancelled: {hung}") and states[2] == states[0], states
        log1 = Path(h.nodes[1].root, "jobs", "hj", "1", "log").read_text()
        assert f"==== airflow-provider-sky: rank 1 {hung}; stack dump of its processes ====" in log1
        assert "==== end of the stack dump of rank 1 ====" in log1
        for r in (0, 2):  # alive ranks: no dump
            assert "stack dump" not in Path(h.nodes[r].root, "jobs", "hj", str(r), "log").read_text()
    finally:
        assert b.terminate("hg").removed


def test_a_retry_starts_through_the_head_which_then_fails_the_attempt_fast_with_nothing_polling(
    sky_home: Path,
) -> None:
    """Attempt 1: rank 1 exits 1 at once. The retry loop (the triggers' shared poll) starts attempt 2
    with one call to the head; then nothing polls, and when rank 1 of attempt 2 exits 3 the head stops
    ranks 0 and 2 as it did in attempt 1."""
    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("rt", task_from_args(num_nodes=3, run="true"))
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then '
        '[ "$SKY_ATTEMPT" = 1 ] && exit 1; sleep 3; exit 3; fi; sleep 10000'
    )
    c = GangClient(b, h)
    # a gang with retries: later attempts start from the nodes' files (the operator sets it so)
    c.keep_secrets = True

    async def until_attempt_2() -> None:
        policy = RetryPolicy.build(1, 0.0, False, [1])
        gen = watch_attempts(c, "rj", policy=policy, poll_interval=0.2, grace=1.0)
        async with contextlib.aclosing(gen) as polls:
            async for poll in polls:
                if poll.attempt == 2:
                    return  # the watcher goes away: nothing polls attempt 2

    try:
        c.launch(task_from_args(num_nodes=3, run=run), "rj", grace=1.0)
        asyncio.run(asyncio.wait_for(until_attempt_2(), 60))
        assert "rj.a2" in c.agent_jobs  # started through the head
        calls = (c.agent_calls, c.node_calls)
        assert _ended(b, h.nodes, "rj.a2", range(3), 3.0 + MARGIN), job_processes(sky_home)
        status, looks = _settled(c, "rj.a2")
        assert c.node_calls == calls[1] and c.agent_calls == calls[0] + looks  # the looks: at the head
        states = {r.rank: r.state.value for r in status.ranks}
        assert states == {0: "cancelled", 1: "failed", 2: "cancelled"}, status.ranks
        assert status.by_rank(1).exit_code == 3
        assert "rank 1 failed first: exited with code 3" in status.by_rank(0).reason
    finally:
        assert b.terminate("rt").removed
    deadline = time.monotonic() + 5
    while job_processes(sky_home) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job_processes(sky_home) == []


def test_the_gangs_lost_after_is_what_the_head_and_the_workers_wait(sky_home: Path) -> None:
    """``lost_after=3`` on the gang (the operator's): a worker's agent stopped is lost after 3 s, not
    after the agents' own 10 s; then, the head's agent stopped, a worker stops the next gang's ranks
    after 3 s too."""
    from integration.test_agent_faults import Agents, _stopped

    b = LocalBackend(sky_home, node_agent=True)
    h = b.provision("la", task_from_args(num_nodes=3, run="true"))
    a = Agents("local", b, h)
    c = GangClient(b, h)

    def lost(job: str, node: int, others: range) -> float:
        """Seconds from node ``node``'s agent stopped to every rank of ``others`` ended."""
        c.launch(task_from_args(num_nodes=3, run="sleep 10000"), job, grace=1.0, lost_after=3.0)
        time.sleep(1.0)
        with _stopped(a.pid(node)):
            t0 = time.monotonic()
            assert _ended(b, h.nodes, job, others, 3.0 + MARGIN)
            return time.monotonic() - t0

    try:
        took = lost("w", 2, range(2))
        print(f"\nlost_after 3 s: a worker's agent stopped -> the others cancelled after {took:.1f} s")
        assert 2.0 <= took < 3.0 + MARGIN, took
        assert "node node-2 (ranks 2) lost" in c.peek("w").by_rank(0).reason
        took = lost("h", 0, range(1, 3))
        assert 2.0 <= took < 3.0 + MARGIN, took
        why = Path(h.nodes[1].root, "jobs", "h", "1", "cancel").read_text()
        assert "stopped answering for 3s (head node lost)" in why, why
    finally:
        assert b.terminate("la").removed
