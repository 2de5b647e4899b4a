"""No call waits without a bound: a status call that never answers is cancelled and its process reaped.

Real hangs, no mocks: a rank's ``polled`` file made a FIFO (the poll's write to it blocks forever, as
on a hung filesystem), a ``wc`` on the node's ``PATH`` that never returns for one rank's log, and on
SSH a script that blocks on a FIFO on a real sshd host. Every node of a local cluster is on this one
machine, so one call asks all of them: a hung rank makes the ranks of its call unreachable for the
round, and the ranks asked in another call read fine.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest
from gangs import local_gang
from leaks import live_processes
from sshd import SSHDCluster, needs_sshd, user_processes

from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.runners.local import LocalRunner
from airflow_provider_sky.watch.jobs import GangClient, run_sync

#: how long past ``status_timeout`` a poll with a hung node may take (the cancel, kill and reap)
SLACK = 2.5


def _children() -> set[int]:
    """Live (non-zombie) child processes of this test process."""
    me = str(os.getpid())
    return {int(entry.name) for entry, stat in live_processes() if stat[1] == me}


def _with_marker(marker: str) -> list[int]:
    """Live processes whose command line contains ``marker``."""
    found = []
    for entry, _ in live_processes():
        try:
            if marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _hang_polled(client: GangClient, rank: int) -> Path:
    """Make the poll's write of ``rank``'s ``polled`` file block forever (a FIFO nobody reads)."""
    path = Path(client.node_of(rank).root) / "jobs" / "job" / str(rank) / "polled"
    path.unlink()
    os.mkfifo(path)
    return path


@pytest.fixture
def hung_gang(sky_home: Path) -> Iterator[GangClient]:
    """A running 3-rank local gang whose rank 1 never answers a poll (``status_timeout`` 1 s)."""
    b, client, spec = local_gang(sky_home, 3, "sleep 60")
    client.launch(spec, "job")
    client.status_timeout = 1.0
    fifo = _hang_polled(client, 1)
    try:
        yield client
    finally:
        fifo.unlink(missing_ok=True)
        client.close()
        b.terminate("c", grace=0.5)


def _check_hung_round(client: GangClient, unreachable: dict[int, str], elapsed: float) -> None:
    assert elapsed < client.status_timeout + SLACK, f"the poll took {elapsed:.1f}s"
    # the three ranks share one call (one machine); each is named by its own address
    assert sorted(unreachable) == [0, 1, 2]
    for rank, why in unreachable.items():
        assert why == f"{client.node_of(rank).ip}: no answer within 1s"


def test_a_poll_with_a_hung_node_returns_and_leaves_no_process(hung_gang: GangClient) -> None:
    before = _children()
    start = time.monotonic()
    poll = hung_gang.poll("job", max_log=0)
    elapsed = time.monotonic() - start
    _check_hung_round(hung_gang, poll.unreachable, elapsed)
    assert {r.state for r in poll.status.ranks} == {"unknown"}
    # the blocked `sh` was killed and reaped when its call was abandoned, not left behind
    assert _children() - before == set()
    # ranks asked without the hung one read fine
    others = run_sync(hung_gang.apoll("job", max_log=0, ranks=[0, 2]))
    assert others.unreachable == {} and [r.state for r in others.status.ranks] == ["running", "running"]


def test_the_sync_wrapper_returns_from_inside_a_running_loop(hung_gang: GangClient) -> None:
    """``run_sync`` called where a loop runs (its thread-pool branch) returns as bounded."""
    before = _children()

    async def caller() -> tuple[float, dict[int, str]]:
        start = time.monotonic()
        poll = hung_gang.poll("job", max_log=0)
        return time.monotonic() - start, poll.unreachable

    elapsed, unreachable = asyncio.run(caller())
    _check_hung_round(hung_gang, unreachable, elapsed)
    assert _children() - before == set()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("sky-run-sync")]


def test_the_next_round_asks_the_hung_node_again(hung_gang: GangClient) -> None:
    """Nothing is kept in the background between rounds, so each round is a fresh, bounded call."""

    async def rounds() -> list[dict[int, str]]:
        out = []
        for _ in range(3):
            out.append((await hung_gang.apoll("job", max_log=0)).unreachable)
            assert _children() == set(), "a call of an earlier round is still running"
        return out

    for unreachable in asyncio.run(rounds()):
        assert sorted(unreachable) == [0, 1, 2]


def test_a_one_off_look_with_a_hung_node_returns_and_leaves_no_process(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``peek`` leaves no mark, so the FIFO does not stop it: a ``wc`` that never returns does.

    The shim runs as a child of the status script, so this also shows the kill reaches the script's
    whole process group (an orphaned ``sleep`` would hold the call's stderr pipe open).
    """
    b, client, spec = local_gang(sky_home, 3, "sleep 60")
    client.launch(spec, "job")
    client.status_timeout = 1.0
    marker = f"9999.{os.getpid()}"  # the hung `sleep`'s argument: unique to this test process
    shims = tmp_path / "shims"
    shims.mkdir()
    hung_log = f"{client.node_of(1).root}/jobs/job/1/log"
    (shims / "wc").write_text(  # hangs when it is to measure rank 1's log, as an argument or on stdin
        "#!/bin/sh\n"
        f'for a in "$@"; do [ "$a" = "{hung_log}" ] && exec sleep {marker}; done\n'
        f'if [ "$(readlink /proc/$$/fd/0)" = "{hung_log}" ]; then exec sleep {marker}; fi\n'
        'exec /usr/bin/wc "$@"\n'
    )
    (shims / "wc").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    try:
        before = _children()
        start = time.monotonic()
        status = client.peek("job")
        elapsed = time.monotonic() - start
        assert elapsed < client.status_timeout + SLACK, f"peek took {elapsed:.1f}s"
        for r in status.ranks:
            assert r.state == "unknown" and r.reason == f"{r.ip}: no answer within 1s", r
        assert _children() - before == set()
        assert _with_marker(marker) == [], "the hung script's child was left running"
        # a rank task looks at its own rank only: rank 0 reads fine, rank 1 alone is unreachable
        assert client.peek("job", ranks=[0]).by_rank(0).state == "running"
        assert [r.state for r in client.peek("job", ranks=[1]).ranks] == ["unknown"]
        assert _with_marker(marker) == []
    finally:
        monkeypatch.undo()
        client.close()
        b.terminate("c", grace=0.5)


def test_run_sync_bounds_the_cleanup_of_tasks_that_ignore_cancellation() -> None:
    """A leftover task that swallows its cancel cannot hold ``run_sync`` forever."""
    released = threading.Event()

    async def stubborn() -> None:
        while not released.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # ignores every cancel

    async def main() -> str:
        asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0)
        return "done"

    start = time.monotonic()
    try:
        assert run_sync(main()) == "done"
    finally:
        released.set()
    assert time.monotonic() - start < 10


def test_a_cancelled_local_call_kills_and_reaps_its_process(sky_home: Path) -> None:
    home = sky_home / "n"
    home.mkdir()
    fifo = home / "fifo"
    os.mkfifo(fifo)
    runner = LocalRunner("127.9.9.9", str(home))
    before = _children()

    async def go() -> None:
        task = asyncio.ensure_future(runner.arun_script('read -r x < "$1"', [str(fifo)]))
        await asyncio.sleep(0.5)
        assert len(_children() - before) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 3)
        assert _children() - before == set()
        start = time.monotonic()
        with pytest.raises(RunnerError, match="timed out after 0.5s"):
            await runner.arun_script('read -r x < "$1"', [str(fifo)], timeout=0.5)
        assert time.monotonic() - start < 3
        assert _children() - before == set()

    asyncio.run(go())


# ------------------------------------------------------------------------------------------- SSH


@needs_sshd
def test_a_cancelled_ssh_call_stops_its_remote_script_and_its_thread(tmp_path: Path) -> None:
    from airflow_provider_sky.runners import ssh

    with SSHDCluster(1, tmp_path) as cluster:
        try:
            runner = ssh.SSHRunner(cluster.node_config(0))
            user = cluster.nodes[0].user
            script = 'rm -f "$HOME/fifo"; mkfifo "$HOME/fifo"; exec 3< "$HOME/fifo"'

            def remote_running() -> bool:
                """The script's ``sh -s`` still runs on the node."""
                return any(b"sh\0-s\0" in _cmdline(p) for p in user_processes(user))

            def pumping() -> bool:
                """A thread is still inside the runner's channel loop."""
                return any("_pump" in _stack(frame) for frame in sys._current_frames().values())

            async def go() -> float:
                task = asyncio.ensure_future(runner.arun_script(script))  # no timeout of its own
                deadline = time.monotonic() + 10
                while not (remote_running() and pumping()):
                    assert time.monotonic() < deadline, "the script never started"
                    await asyncio.sleep(0.05)
                start = time.monotonic()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await asyncio.wait_for(task, 5)
                return time.monotonic() - start

            assert asyncio.run(go()) < 3.5
            deadline = time.monotonic() + 3
            while pumping() or remote_running():
                assert time.monotonic() < deadline, "the remote script or its thread is still running"
                time.sleep(0.05)
            assert runner.run_script("echo fine", timeout=10).text == "fine\n"
            runner.close()
        finally:
            ssh.close_all()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _stack(frame: FrameType | None) -> list[str]:
    """The function names on a thread's stack."""
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return names
