"""The machine stops a gang by itself: the first rank of a machine to fail cancels its siblings there,
with no watcher polling (the watchers' poll does the same across machines, a poll later)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from gangs import local_gang

from airflow_provider_sky.model.gang import CANCELLED, FAILED, RUNNING, SUCCEEDED
from airflow_provider_sky.node.runtime import env_file, gang_flag, node_cancel_reason
from airflow_provider_sky.node.shell import CMD_PROLOGUE, WRAPPER
from airflow_provider_sky.watch.jobs import run_sync
from integration.test_containment import ESCAPES, _alive, _marked, _wait_for


def _over(client, n: int) -> bool:
    return all(r.terminal for r in client.peek("job").ranks) and len(client.peek("job").ranks) == n


def test_a_failing_rank_cancels_its_siblings_on_the_machine_with_no_watcher(sky_home: Path) -> None:
    """Nothing polls this job: before, the 15 siblings slept on until a watcher came; now they are gone
    within a second of rank 5's segfault, each cancelled with the cause, their escaped children too."""
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = 5 ]; then sleep 2; kill -SEGV $$; fi\n'
        'if [ "$SKYPILOT_NODE_RANK" = 9 ]; then\n' + ESCAPES + "fi\n"
        "sleep 10000"
    )
    b, client, spec = local_gang(sky_home, 16, run)
    client.launch(spec, "job", grace=1.0)
    assert _wait_for(lambda: _over(client, 16), 15), client.peek("job").ranks
    status = client.peek("job")
    failed = status.by_rank(5)
    assert failed.state == FAILED and failed.reason == "segmentation fault (SIGSEGV)", failed
    for r in status.ranks:
        if r.rank != 5:
            assert r.state == CANCELLED, r
            assert r.reason == "cancelled: rank 5 failed first: segmentation fault (SIGSEGV)", r
    assert status.root_cause() is not None and status.root_cause().rank == 5
    gone = max(r.end for r in status.ranks if r.rank != 5) - failed.end
    assert gone < 1.0, f"the last sibling ended {gone:.2f} s after the failure"
    # the escaped processes of rank 9 go too (found by their mark), within the grace
    assert _wait_for(lambda: not _alive(_marked(f"{client.node_of(9).root}/jobs/job/9/")), 5)
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_a_sibling_that_exits_nonzero_on_the_signal_is_cancelled_not_failed(sky_home: Path) -> None:
    """The machine signals the siblings before any of their reasons is written (1,000 reason files take
    the disk most of a second); a sibling whose program catches SIGTERM and exits 1, as a training
    script's handler does, must still read as cancelled by rank 0, never as a second failure."""
    run = (
        "if [ \"$SKYPILOT_NODE_RANK\" = 0 ]; then sleep 1; exit 3; fi\ntrap 'exit 1' TERM\nsleep 10000 & wait"
    )
    b, client, spec = local_gang(sky_home, 4, run)
    client.launch(spec, "job", grace=2.0)
    assert _wait_for(lambda: _over(client, 4), 15), client.peek("job").ranks
    status = client.peek("job")
    for r in status.ranks:
        if r.rank != 0:
            assert r.state == CANCELLED and r.exit_code == 1, r
            assert r.reason == "cancelled: rank 0 failed first: exited with code 3", r
    assert status.root_cause() is not None and status.root_cause().rank == 0
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_a_cancelled_or_successful_rank_does_not_stop_its_siblings(sky_home: Path) -> None:
    """Only a rank failing on its own stops the machine: a rank a watcher cancelled (exit 143) and a
    rank that exited 0 leave the others running."""
    run = 'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then exit 0; fi; sleep 10000'
    b, client, spec = local_gang(sky_home, 4, run)
    client.launch(spec, "job", grace=1.0)
    client.cancel("job", [1], grace=1.0, reason="a user asked")
    time.sleep(1.5)
    states = {r.rank: (r.state, r.reason) for r in client.peek("job").ranks}
    assert states[0] == (SUCCEEDED, "succeeded")
    assert states[1] == (CANCELLED, "cancelled: a user asked")
    assert states[2][0] == RUNNING and states[3][0] == RUNNING, states
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_a_watchers_fail_fast_leaves_a_machine_that_cancels_itself_to_it(sky_home: Path) -> None:
    """Once a failing rank has claimed its machine's cancel (``.cancelling``), a watcher's first
    fail-fast cancel of that machine does nothing: the machine's covers every rank there, and a second
    one writing a reason file per rank took the CPU the first one's victims needed (1,024 ranks). A
    cancel sent again, or any other cancel, still goes through."""
    b, client, spec = local_gang(sky_home, 4, "sleep 10000")
    client.launch(spec, "job", grace=1.0)
    claim = Path(gang_flag(client.node_of(0).root, "job")).parent / ".cancelling"
    claim.mkdir()
    run_sync(client.acancel("job", [1, 2], 1.0, wait=False, reason="rank 7 failed", fail_fast=True))
    time.sleep(1.0)
    assert {r.rank: r.state for r in client.peek("job").ranks} == dict.fromkeys(range(4), RUNNING)
    run_sync(client.acancel("job", [1], 1.0, wait=False, reason="sent again"))
    claim.rmdir()
    run_sync(client.acancel("job", [2], 1.0, wait=False, reason="rank 7 failed", fail_fast=True))
    assert _wait_for(lambda: all(r.terminal for r in client.peek("job").ranks[1:3]), 5)
    states = {r.rank: (r.state, r.reason) for r in client.peek("job").ranks}
    assert states[1] == (CANCELLED, "cancelled: sent again")
    assert states[2] == (CANCELLED, "cancelled: rank 7 failed")
    assert states[0][0] == RUNNING and states[3][0] == RUNNING, states
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def test_each_sibling_gets_one_sigterm_from_the_machine(sky_home: Path, tmp_path: Path) -> None:
    """The failing rank signals the groups listed in ``.pgids`` at once, then the machine's cancel does
    the rest: no group may get a second SIGTERM (a training script's handler, interrupted by a second
    one while it saves a checkpoint, may give up on it)."""
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then sleep 1.5; exit 3; fi\n'
        f"trap 'echo TERM >> {tmp_path}/terms.$SKYPILOT_NODE_RANK; sleep 0.5; exit 1' TERM\n"
        "sleep 10000 & wait"
    )
    b, client, spec = local_gang(sky_home, 8, run)
    client.launch(spec, "job", grace=3.0)
    assert _wait_for(lambda: _over(client, 8), 15), client.peek("job").ranks
    time.sleep(1.0)  # a second signal would run the handler again after this one
    for r in range(1, 8):
        assert (tmp_path / f"terms.{r}").read_text() == "TERM\n", r
    for r in client.peek("job").ranks[1:]:
        assert r.state == CANCELLED and r.reason == "cancelled: rank 0 failed first: exited with code 3", r
    b.terminate("c")


def test_a_group_number_of_an_ended_rank_is_not_signalled(sky_home: Path) -> None:
    """``.pgids`` keeps the group of every rank that started; a rank that has ended may see its number
    reused by another process group. The failing rank skips every listed rank with an exit record."""
    run = 'if [ "$SKYPILOT_NODE_RANK" = 1 ]; then exit 0; fi\nif [ "$SKYPILOT_NODE_RANK" = 0 ]; then sleep 3; exit 3; fi\nsleep 10000'
    b, client, spec = local_gang(sky_home, 3, run)
    client.launch(spec, "job", grace=1.0)
    assert _wait_for(lambda: client.peek("job").by_rank(1).terminal, 10)
    other = subprocess.Popen(["sleep", "10000"], start_new_session=True)  # the number, reused
    try:
        pgids = Path(gang_flag(client.node_of(0).root, "job")).parent / ".pgids"
        listed = pgids.read_text()
        assert {line.split()[0] for line in listed.splitlines()} == {"0", "1", "2"}, listed
        pgids.write_text(
            "".join(f"1 {other.pid}\n" if ln.startswith("1 ") else ln + "\n" for ln in listed.splitlines())
        )
        assert _wait_for(lambda: _over(client, 3), 15), client.peek("job").ranks
        assert client.peek("job").by_rank(2).state == CANCELLED
        time.sleep(0.5)
        assert other.poll() is None, "a process group that is not the job's was signalled"
    finally:
        other.kill()
        other.wait()
    b.terminate("c")


def test_a_running_rank_listed_with_a_group_not_its_own_does_not_signal_that_group(sky_home: Path) -> None:
    """A rank whose group ended without an exit record (its wrapper died with it) still has its line in
    ``.pgids``, and the number may be another process group's by now: the failing rank signals a listed
    group only while its first process is a child of that rank's wrapper."""
    run = 'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then sleep 2; exit 3; fi\nsleep 10000'
    b, client, spec = local_gang(sky_home, 3, run)
    client.launch(spec, "job", grace=1.0)
    pgids = Path(gang_flag(client.node_of(0).root, "job")).parent / ".pgids"
    assert _wait_for(lambda: pgids.exists() and len(pgids.read_text().splitlines()) == 3, 10)
    other = subprocess.Popen(["sleep", "10000"], start_new_session=True)  # the number, given out again
    try:
        with pgids.open("a") as f:
            f.write(f"1 {other.pid}\n")
        assert _wait_for(lambda: _over(client, 3), 15), client.peek("job").ranks
        assert [r.state for r in client.peek("job").ranks] == [FAILED, CANCELLED, CANCELLED]
        time.sleep(1.5)  # past the grace: the cancel's SIGKILL too
        assert other.poll() is None, "a process group that is not the job's was signalled"
    finally:
        other.kill()
        other.wait()
    b.terminate("c")


def test_the_ranks_clock_is_the_wall_clock(sky_home: Path) -> None:
    """The wrappers read /proc/uptime from a base their launcher took with ``date`` (no fork per
    timestamp): a rank's start and end still read as the wall clock, to the hundredth."""
    b, client, spec = local_gang(sky_home, 2, "sleep 1")
    before = time.time()
    client.launch(spec, "job")
    assert _wait_for(lambda: _over(client, 2), 10)
    after = time.time()
    for r in client.peek("job").ranks:
        assert r.start is not None and r.end is not None, r
        assert before - 0.02 <= r.start <= r.end <= after + 0.02, (before, r.start, r.end, after)
        assert 0.95 <= r.end - r.start <= 1.5, r
        assert len(str(r.end).split(".")[1]) <= 2  # centiseconds: the uptime clock was used
    b.terminate("c")


def test_a_sibling_whose_group_is_not_there_yet_is_signalled_by_pid(sky_home: Path) -> None:
    """A wrapper lists its child's pid as its group as soon as it forked it; the child makes the group
    (setsid) a moment later, seconds later on a machine starting 1,000 ranks. A failure in between must
    still reach it: its group not there, the process is signalled itself (a 1,024-rank run had one
    sibling live 9 s past the failure)."""
    run = 'if [ "$SKYPILOT_NODE_RANK" = 0 ]; then sleep 2; exit 3; fi\nsleep 10000'
    b, client, spec = local_gang(sky_home, 3, run)
    client.launch(spec, "job", grace=5.0)
    pgids = Path(gang_flag(client.node_of(0).root, "job")).parent / ".pgids"
    assert _wait_for(lambda: pgids.exists() and len(pgids.read_text().splitlines()) == 3, 10)
    lone = subprocess.Popen(
        ["sleep", "10000"]
    )  # a process, no group of its own: rank 1's child before setsid
    try:
        listed = pgids.read_text().splitlines()
        pgids.write_text("".join(f"1 {lone.pid}\n" if ln.startswith("1 ") else ln + "\n" for ln in listed))
        # its parent (this process) as rank 1's wrapper, as a wrapper's child before setsid has it
        (Path(client.node_of(1).root) / "jobs" / "job" / "1" / "pid").write_text(f"{os.getpid()}\n")
        assert _wait_for(lambda: lone.poll() is not None, 5), "the process of a group not made yet lived on"
        assert lone.returncode == -15
    finally:
        lone.kill()
        lone.wait()
    assert _wait_for(lambda: _over(client, 3), 15), client.peek("job").ranks
    b.terminate("c")


def test_a_slow_date_does_not_shift_the_ranks_clock(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher's ``date`` (a fork) answering late on a busy machine made every rank it started
    tell its times that much early; the base is now read between two uptime reads and retried when
    they are far apart. A ``date`` whose first answer comes 0.5 s after it read the time must not show."""
    real = subprocess.run(["sh", "-c", "command -v date"], capture_output=True, text=True).stdout.strip()
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "date").write_text(
        f'#!/bin/sh\nout=$({real} "$@")\necho "$out"\n'
        f'if [ "$*" = +%s%N ] && mkdir {tmp_path}/slow 2>/dev/null; then sleep 0.5; fi\n'
    )
    (fake / "date").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    b, client, spec = local_gang(sky_home, 1, f"{real} +%s.%N > {tmp_path}/own; sleep 0.2")
    client.launch(spec, "job")
    assert (tmp_path / "slow").is_dir()  # the slow answer was given
    assert _wait_for(lambda: _over(client, 1), 10)
    r = client.peek("job").ranks[0]
    own = float((tmp_path / "own").read_text())  # the rank's own wall clock, right after its start
    assert r.start is not None and -0.03 <= own - r.start < 0.2, (own, r.start)
    b.terminate("c")


def test_a_later_attempt_of_the_gang_stops_on_the_machine_too(sky_home: Path) -> None:
    """A whole-gang retry starts attempt k from attempt 1's files: its ranks are listed for the
    machine's own fail-fast as a first start's are."""
    import asyncio

    from airflow_provider_sky.watch import retry

    run = 'if [ "${SKY_ATTEMPT:-1}" = 2 ] && [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 1; exit 7; fi; sleep 10000'
    b, client, spec = local_gang(sky_home, 4, run)
    client.launch(spec, "job", grace=1.0)
    client.cancel("job", grace=1.0, reason="attempt 1 is over")
    assert asyncio.run(retry._relaunch(client, "job", 2)) == ""
    assert _wait_for(lambda: all(r.terminal for r in client.peek("job.a2").ranks), 10)
    status = client.peek("job.a2")
    assert status.by_rank(1).reason == "exited with code 7"
    for r in (0, 2, 3):
        assert status.by_rank(r).reason == "cancelled: rank 1 failed first: exited with code 7", (
            status.by_rank(r)
        )
    assert max(status.by_rank(r).end for r in (0, 2, 3)) - status.by_rank(1).end < 1.0
    b.terminate("c")
    assert not _alive(_marked(str(sky_home)))


def _rank_dir(root: Path, command: str) -> Path:
    """A rank directory as the launcher writes it (command, env, a secret, the wrapper), not started."""
    d = root / "jobs" / "job" / "0"
    d.mkdir(parents=True)
    (d / "cmd.sh").write_text(CMD_PROLOGUE + command)
    (d / "env").write_text(env_file({"A": "1"}))
    (d / "secrets").write_text(env_file({"TOKEN": "s3cret"}))
    (d / "rank.sh").write_text(WRAPPER)
    return d


def test_a_rank_cancelled_before_its_command_started_never_runs_it(tmp_path: Path) -> None:
    """A cancel that reaches a rank before its process group exists can only leave its reason: the
    wrapper then must not start the command at all (before, it started it and the rank ran on)."""
    marker = tmp_path / "ran"
    d = _rank_dir(tmp_path, f"touch {marker}\nsleep 10000\n")
    (d / "cancel").write_text("a user asked\n")
    subprocess.run(["sh", str(d / "rank.sh"), str(d), str(tmp_path)], timeout=20, check=True)
    assert not marker.exists()
    assert (d / "exit").read_text() == "143\n" and (d / "end").read_text().strip()
    assert (d / "cancel").read_text() == "a user asked\n"
    assert not (d / "secrets").exists()  # never sourced, so removed here


def test_a_rank_whose_machine_has_failed_never_runs_its_command(tmp_path: Path) -> None:
    """A wrapper that starts after a rank of its machine failed (the gang flag is set) does not start
    the command: it is recorded cancelled by that rank, as the launcher records the ranks it skips."""
    marker = tmp_path / "ran"
    d = _rank_dir(tmp_path, f"touch {marker}\n")
    flag = d.parent / ".failed"
    flag.write_text("3 1\n")
    subprocess.run(["sh", str(d / "rank.sh"), str(d), str(tmp_path), str(flag)], timeout=20, check=True)
    assert not marker.exists()
    assert (d / "exit").read_text() == "143\n"
    # nothing ran: no duration (readers tell a never-started rank by start = end)
    assert (d / "start").read_text() == (d / "end").read_text()
    assert node_cancel_reason((d / "cancel").read_text().strip()) == "rank 3 failed first: exited with code 1"
    assert not (d / "secrets").exists()
