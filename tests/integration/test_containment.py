"""Nothing escapes a cluster: processes found by their mark, unreadable exit files, the node's keeper."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path

import pytest
from gangs import local_gang, rank_exit, wait_done

from airflow_provider_sky.backends.base import Node
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.runners.local import LocalRunner
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient


def _marked(prefix: str) -> list[int]:
    """Pids whose environment carries a mark under ``prefix`` (the way the nodes find them)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if f"SKY_PROVIDER_MARK={prefix}".encode() in env:
            found.append(int(entry))
    return found


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            out.append(pid)
    return out


def _keepers(root: str) -> list[int]:
    """The live keepers of the machine whose first root is ``root``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if f"SKY_KEEPER_ROOTS={root}".encode() in env and b"sky-keeper" in cmd:
                out.append(int(entry))
    return _alive(out)


def _wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


# processes a rank leaves behind in ways a process group does not catch
ESCAPES = (
    "setsid sleep 10000 &\n"  # its own session and group
    "( ( sleep 10001 & ) & )\n"  # double fork, re-parented to init
    "nohup sh -c 'sleep 10002' >/dev/null 2>&1 &\n"
)


def test_fail_fast_kills_what_cancelled_ranks_started_in_other_sessions(sky_home: Path) -> None:
    run = ESCAPES + 'if [ "$SKYPILOT_NODE_RANK" = "1" ]; then sleep 1; exit 4; fi\nsleep 10000'
    b, client, spec = local_gang(sky_home, 3, run)
    client.launch(spec, "job")
    root = client.node_of(0).root
    assert _wait_for(lambda: len(_alive(_marked(f"{root}/jobs/job/0/"))) >= 4)
    poll = wait_done(client, grace=1.0)
    assert [r.state for r in poll.status.ranks] == ["cancelled", "failed", "cancelled"]
    for rank in (0, 2):
        prefix = f"{client.node_of(rank).root}/jobs/job/{rank}/"
        assert _wait_for(lambda p=prefix: not _alive(_marked(p)), 5), f"rank {rank} left processes"
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_teardown_kills_what_a_successful_rank_left_running(sky_home: Path) -> None:
    b, client, spec = local_gang(sky_home, 2, ESCAPES + "exit 0")
    client.launch(spec, "job")
    poll = wait_done(client)
    assert poll.status.succeeded
    root = client.node_of(0).root
    assert len(_alive(_marked(f"{root}/jobs/"))) >= 3  # the rank is over; its leftovers are not
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_a_deleted_job_directory_loses_no_process(sky_home: Path) -> None:
    b, client, spec = local_gang(sky_home, 2, ESCAPES + "sleep 10000")
    client.launch(spec, "job")
    root = Path(client.node_of(1).root)
    assert _wait_for(lambda: len(_alive(_marked(f"{root}/jobs/job/1/"))) >= 4)
    shutil.rmtree(root / "jobs" / "job" / "1")
    poll = wait_done(client, grace=1.0, lost_after=0.5)
    assert poll.status.by_rank(1).state == "lost" and "job directory is gone" in poll.status.by_rank(1).reason
    assert poll.status.by_rank(0).state == "cancelled"
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


@pytest.mark.parametrize("garbage", ["1 2 3", "garbage", ""])
def test_an_unreadable_exit_file_fails_the_rank_with_its_text(sky_home: Path, garbage: str) -> None:
    run = 'if [ "$SKYPILOT_NODE_RANK" = "1" ]; then sleep 0.3; exit 0; fi\nsleep 10000'
    b, client, spec = local_gang(sky_home, 2, run)
    client.launch(spec, "job")
    exit_file = Path(client.node_of(1).root) / "jobs" / "job" / "1" / "exit"
    # its code is in (the wrapper writes the file in place: it exists, empty, a moment before)
    assert _wait_for(lambda: (rank_exit(exit_file.parent) or ("",))[0] == "0")
    exit_file.write_text(garbage + "\n")
    poll = wait_done(client, grace=1.0)
    bad = poll.status.by_rank(1)
    assert bad.state == "failed", "the rank silently dropped out or succeeded"
    assert repr(garbage) in bad.reason and "exit file" in bad.reason
    assert poll.status.by_rank(0).state == "cancelled"
    assert len(poll.status.ranks) == 2
    b.terminate("c")


def test_the_node_kills_a_job_nobody_polls(sky_home: Path) -> None:
    """The dead-man's switch: a lost scheduler or killed ``dags test`` leaves no job running."""
    b, client, spec = local_gang(sky_home, 2, ESCAPES + "sleep 10000")
    client.launch(spec, "job", orphan_timeout=2)
    root = client.node_of(0).root
    assert _wait_for(lambda: len(_alive(_marked(f"{root}/jobs/job/0/"))) >= 4)
    assert _wait_for(lambda: not _alive(_marked(str(sky_home))), 15), "the orphaned job still runs"
    poll = client.poll("job", max_log=0)
    for r in poll.status.ranks:
        assert r.state == "failed" and r.reason.startswith("orphaned"), r
    b.terminate("c")


def test_a_polled_job_is_not_orphaned(sky_home: Path) -> None:
    b, client, spec = local_gang(sky_home, 2, "sleep 5; echo done")
    client.launch(spec, "job", orphan_timeout=2)
    poll = wait_done(client)
    assert poll.status.succeeded
    b.terminate("c")


def test_orphan_timeout_zero_turns_the_switch_off(sky_home: Path) -> None:
    b, client, spec = local_gang(sky_home, 1, "sleep 10000")
    client.launch(spec, "job", orphan_timeout=0)
    time.sleep(3)
    assert client.poll("job", max_log=0).status.ranks[0].state == "running"
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_teardown_stops_the_keeper(sky_home: Path) -> None:
    b, client, spec = local_gang(sky_home, 2, "sleep 10000")
    client.launch(spec, "job", orphan_timeout=600)
    roots = [n.root for n in client.handle.nodes]

    def keepers() -> list[int]:
        return _keepers(roots[0])

    assert _wait_for(lambda: len(keepers()) == 1), "one keeper for the machine's nodes"
    down = b.terminate("c")
    assert _wait_for(lambda: not keepers(), 3), down


def test_a_teardown_right_after_the_launch_stops_the_keeper(sky_home: Path) -> None:
    """The keeper may not have written its pid yet when a teardown comes: the launcher writes it."""
    for _ in range(3):
        b, client, spec = local_gang(sky_home, 2, "sleep 10000")
        client.launch(spec, "job", orphan_timeout=600)
        root = client.handle.nodes[0].root
        down = b.terminate("c")
        assert _wait_for(lambda root=root: not _keepers(root), 3), f"the keeper outlived the teardown: {down}"


def test_an_idle_cluster_goes_down_by_itself(sky_home: Path) -> None:
    """``idle_down`` (SkyPilot's autodown): a cluster kept after its run is removed once idle."""
    b, client, spec = local_gang(sky_home, 2, "setsid sleep 10000 & sleep 1")
    client.launch(spec, "job", idle_down=2)
    poll = wait_done(client)
    assert poll.status.succeeded and b.find("c") is not None
    time.sleep(1)
    assert b.find("c") is not None, "went down before idle_down"
    assert _wait_for(lambda: b.find("c") is None, 15), "the idle cluster is still there"
    assert not (sky_home / "local" / "c").exists()
    assert not _alive(_marked(str(sky_home)))
    # the address block is free again: a new cluster of that name starts afresh
    spec2 = task_from_args(num_nodes=2, run="true")
    assert b.provision("c", spec2).name == "c"
    b.terminate("c")


def test_a_running_job_keeps_an_idle_down_cluster(sky_home: Path) -> None:
    b, client, spec = local_gang(sky_home, 1, "sleep 5")
    client.launch(spec, "job", idle_down=1, orphan_timeout=0)
    time.sleep(3.5)
    assert b.find("c") is not None
    assert client.poll("job", max_log=0).status.ranks[0].state == "running"
    b.terminate("c")


class _SlowHandshakeRunner(LocalRunner):
    """A local node whose connection takes ``delay`` seconds to open, like a far SSH host."""

    def __init__(self, host: str, home: str, delay: float) -> None:
        super().__init__(host, home)
        self.delay = delay

    async def aconnect(self) -> None:
        await asyncio.sleep(self.delay)


class _SlowStartBackend(LocalBackend):
    """Nodes 4 and up answer 1.5 s late: the gang start is still running when rank 1 fails. Each node
    counts as a machine of its own (as SSH hosts do), so each has its own connection and start call."""

    def machine_of(self, node: Node) -> str:
        return node.node_id

    def runner(self, node: Node) -> LocalRunner:
        rank = int(node.node_id.split("-")[1])
        return _SlowHandshakeRunner(node.ip, node.home, 1.5 if rank >= 4 else 0.0)


class _SlowAnswerRunner(LocalRunner):
    """A local node whose start call answers ``delay`` seconds after its ranks started (a far host's
    slow reply): the ranks run while the call is still in flight."""

    def __init__(self, host: str, home: str, delay: float) -> None:
        super().__init__(host, home)
        self.delay = delay

    async def arun_script(self, script: str, args: list[str] | None = None, timeout: float | None = None):  # type: ignore[no-untyped-def]
        res = await super().arun_script(script, args, timeout)
        if "rank.sh" in script:  # a gang start
            await asyncio.sleep(self.delay)
        return res


class _SlowAnswerBackend(_SlowStartBackend):
    """Nodes 4 and up start their ranks at once but answer the start 4 s late."""

    def runner(self, node: Node) -> LocalRunner:
        rank = int(node.node_id.split("-")[1])
        return _SlowAnswerRunner(node.ip, node.home, 4.0 if rank >= 4 else 0.0)


def test_a_failure_stops_the_start_calls_still_in_flight(sky_home: Path) -> None:
    """Rank 1 fails at once while the start calls of ranks 4-7 have not answered (their ranks run): the
    launch writes the failure into those machines' flags and cancels their ranks on a channel of its
    own, instead of when each call answers (4 s later)."""
    b = _SlowAnswerBackend(sky_home)
    run = 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 1; fi; sleep 10000'
    spec = task_from_args(num_nodes=8, run=run)
    client = GangClient(b, b.provision("c", spec))
    t0 = time.time()
    client.launch(spec, "job", grace=1.0)
    assert time.time() - t0 >= 4.0  # the slow answers were waited for
    status = client.peek("job")
    fail_end = status.by_rank(1).end
    assert fail_end is not None
    for r in status.ranks:
        if r.rank != 1:
            assert (
                r.state == "cancelled" and r.reason == "cancelled: rank 1 failed first: exited with code 1"
            ), r
            assert r.end is not None and r.end - fail_end < 2.0, (
                f"rank {r.rank} ran on {r.end - fail_end:.1f} s"
            )
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_a_rank_failing_during_the_gang_start_stops_it(sky_home: Path) -> None:
    b = _SlowStartBackend(sky_home)
    run = 'touch "$HOME/ran"; if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 1; fi; sleep 10000'
    spec = task_from_args(num_nodes=8, run=run)
    client = GangClient(b, b.provision("c", spec))
    started = client.launch(spec, "job", grace=1.0)
    assert started == {**dict.fromkeys(range(4), "STARTED"), **dict.fromkeys(range(4, 8), "CANCELLED")}
    status = client.peek("job")
    assert status.root_cause() is not None and status.root_cause().rank == 1
    fail_end = status.by_rank(1).end
    for r in status.ranks:
        if r.rank == 1:
            continue
        assert r.state == "cancelled" and r.reason == "cancelled: rank 1 failed first: exited with code 1", r
    # ranks 4-7 never ran their command; rank 1 did (it failed). Ranks 0, 2 and 3 were started, but on a
    # loaded machine the cancel can reach one before its shell ran the first command, so they are not checked
    ran = {rank: (Path(client.node_of(rank).home) / "ran").exists() for rank in range(8)}
    assert ran[1] and not any(ran[rank] for rank in range(4, 8)), ran
    assert _wait_for(lambda: all(r.terminal for r in client.peek("job").ranks), 5)
    stopped = [r for r in client.peek("job").ranks if r.rank in (0, 2, 3)]
    # stopped by the SIGTERM (143), not by the SIGKILL after the 1 s grace (137), and at once: ~0.1 s on
    # an idle machine (the goal, "about a second", is figure 1's); 2 s holds at a load average of 30 on
    # 2 cores, where the 1-s bound was once missed by 10 ms
    assert [r.exit_code for r in stopped] == [143] * 3, stopped
    assert fail_end is not None and max(r.end or 0 for r in stopped) - fail_end < 2.0, stopped
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_a_rank_failing_in_its_first_second_stops_a_wide_start_on_one_machine(sky_home: Path) -> None:
    """128 ranks on one machine start in four parallel calls of 32: once rank 0 has failed, the nodes'
    launchers start no more siblings (they did not know before: the launch-side watch only sees a call's
    ranks when the whole call is done, and every sibling started, to be killed a moment later)."""
    run = 'touch "$HOME/ran"; if [ "$SKYPILOT_NODE_RANK" = 0 ]; then exit 3; fi; sleep 10000'
    b, client, spec = local_gang(sky_home, 128, run)
    words = client.launch(spec, "job", grace=1.0)
    never = [r for r, w in words.items() if w == "CANCELLED"]
    assert len(never) >= 64, f"only {len(never)} of 127 siblings were not started: {words}"
    assert set(words.values()) <= {"STARTED", "CANCELLED"}, words
    status = client.peek("job")
    assert status.root_cause() is not None and status.root_cause().rank == 0
    for r in status.ranks[1:]:
        assert r.state == "cancelled" and r.reason == "cancelled: rank 0 failed first: exited with code 3", r
    for rank in never:
        assert not (Path(client.node_of(rank).home) / "ran").exists(), f"rank {rank} ran"
    assert _wait_for(lambda: all(r.terminal for r in client.peek("job").ranks), 10)
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))
