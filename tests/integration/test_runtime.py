"""The node runtime on real local processes: exit codes always recorded, trees killed, logs by offset."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from gangs import wait_done
from leaks import job_processes, processes_under

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient, run_sync


@pytest.fixture
def backend(sky_home: Path) -> LocalBackend:
    return LocalBackend(sky_home)


def _gang(backend: LocalBackend, name: str, n: int, run: str, **kw: object) -> tuple[GangClient, object]:
    spec = task_from_args(num_nodes=n, run=run, **kw)
    handle = backend.provision(name, spec)
    return GangClient(backend, handle), spec


@pytest.mark.parametrize(
    ("run", "code"),
    [
        ("exit 3", 3),
        ("exec sh -c 'exit 4'", 4),
        ("set -e\nfalse\necho never", 1),
        ("kill -SEGV $$", 139),
        ("no_such_command_xyz", 127),
        ("true", 0),
    ],
)
def test_exit_code_is_recorded_whatever_the_command_does(backend: LocalBackend, run: str, code: int) -> None:
    client, spec = _gang(backend, "c", 1, run)
    client.launch(spec, "job")
    poll = wait_done(client, "job")
    assert poll.status.ranks[0].exit_code == code
    backend.terminate("c")


def test_log_by_offset_and_rank_env(backend: LocalBackend) -> None:
    client, spec = _gang(
        backend, "c", 2, 'echo "r=$SKYPILOT_NODE_RANK"; echo err >&2; printf "x%.0s" $(seq 1 5000)'
    )
    client.launch(spec, "job")
    wait_done(client, "job")
    whole = client.poll("job", max_log=1 << 20).chunks[1][1]
    assert whole.startswith(b"r=1\nerr\n") and whole.count(b"x") == 5000
    part = client.poll("job", {1: 4}, max_log=4).chunks[1]
    assert part == (4, b"err\n")
    backend.terminate("c")


def test_env_values_arrive_verbatim_and_nothing_extra_runs(backend: LocalBackend, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    nasty = f"a'b\"c $(touch {canary}) `touch {canary}`; touch {canary} && echo x\nline2 \u00e9\u6f22"
    client, spec = _gang(backend, "c", 1, 'printf %s "$NASTY"', envs={"NASTY": nasty})
    client.launch(spec, "job")
    wait_done(client, "job")
    assert client.poll("job").chunks[0][1].decode() == nasty
    assert not canary.exists()
    backend.terminate("c")


def test_secrets_not_on_command_lines_nor_left_on_disk(backend: LocalBackend) -> None:
    secret = "s3cr3t-value-" + os.urandom(4).hex()
    client, spec = _gang(
        backend, "c", 2, 'test "$TOKEN" = "' + secret + '" && sleep 3', secrets={"TOKEN": secret}
    )
    client.launch(spec, "job")
    time.sleep(0.5)
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert secret not in ps
    jobs = Path(client.handle.nodes[0].root) / "jobs" / "job" / "0"
    assert not (jobs / "secrets").exists()  # sourced once by the child shell, then removed
    assert oct((jobs / "env").stat().st_mode & 0o777) == "0o600"
    poll = wait_done(client, "job")
    assert [r.state for r in poll.status.ranks] == ["succeeded", "succeeded"]
    backend.terminate("c")


def test_fail_fast_kills_whole_process_trees(backend: LocalBackend, sky_home: Path) -> None:
    run = (
        'if [ "$SKYPILOT_NODE_RANK" = "2" ]; then sleep 0.5; exit 1; fi\n'
        "sh -c 'sleep 10000' & sh -c 'sleep 10000' & wait"
    )
    client, spec = _gang(backend, "c", 4, run)
    client.launch(spec, "job")
    poll = wait_done(client, "job", grace=2.0)
    states = {r.rank: r.state for r in poll.status.ranks}
    assert states == {0: "cancelled", 1: "cancelled", 2: "failed", 3: "cancelled"}
    assert "rank 2" in poll.status.failure_message()
    assert not [p for p in processes_under(sky_home) if "sleep" in p[1]]
    backend.terminate("c")


def test_term_ignoring_rank_is_killed_after_grace(backend: LocalBackend, sky_home: Path) -> None:
    run = 'if [ "$SKYPILOT_NODE_RANK" = "1" ]; then sleep 0.3; exit 2; fi\ntrap "" TERM\nsleep 10000'
    client, spec = _gang(backend, "c", 2, run)
    client.launch(spec, "job")
    t = time.time()
    poll = wait_done(client, "job", grace=1.0)
    assert poll.status.by_rank(0).state == "cancelled"
    assert time.time() - t < 10
    assert not [p for p in processes_under(sky_home) if "sleep" in p[1]]
    backend.terminate("c")


def test_a_rank_is_either_started_or_recorded_never_started_never_both(
    backend: LocalBackend, tmp_path: Path
) -> None:
    """The gang start's launchers and its never-started records (a sibling failed first) claim a rank
    the same way: whichever comes first wins, and the other leaves the rank alone. Rank 2's directory
    exists but nobody claimed it (a launcher makes every directory of its call first)."""
    counter = tmp_path / "count"
    client, spec = _gang(backend, "c", 3, f"echo x >> {counter}-$SKYPILOT_NODE_RANK")
    (Path(client.handle.nodes[2].root) / "jobs" / "job" / "2").mkdir(parents=True)
    recorded = run_sync(client._record_never_started("job", [1, 2], "rank 7 failed first"))
    assert recorded == {1: "CANCELLED", 2: "CANCELLED"}
    assert client.launch(spec, "job") == {0: "STARTED", 1: "EXISTS", 2: "EXISTS"}
    assert run_sync(client._record_never_started("job", [0, 1], "late")) == {0: "EXISTS", 1: "EXISTS"}
    poll = wait_done(client, "job")
    assert [r.state for r in poll.status.ranks] == ["succeeded", "cancelled", "cancelled"]
    assert "rank 7 failed first" in (poll.status.by_rank(2).reason or "")
    assert (tmp_path / "count-0").read_text() == "x\n"
    assert not (tmp_path / "count-1").exists() and not (tmp_path / "count-2").exists()
    backend.terminate("c")


def test_relaunching_the_same_job_id_never_starts_a_rank_twice(backend: LocalBackend, tmp_path: Path) -> None:
    counter = tmp_path / "count"
    client, spec = _gang(backend, "c", 2, f"echo x >> {counter}-$SKYPILOT_NODE_RANK")
    assert set(client.launch(spec, "job").values()) == {"STARTED"}
    assert set(client.launch(spec, "job").values()) == {"EXISTS"}
    wait_done(client, "job")
    assert (tmp_path / "count-0").read_text() == "x\n"
    backend.terminate("c")


def test_concurrent_jobs_on_the_same_nodes_are_isolated(backend: LocalBackend) -> None:
    client, spec = _gang(backend, "c", 2, "sleep 1")
    bad = task_from_args(num_nodes=2, run="exit 1")
    client.launch(spec, "good")
    client.launch(bad, "bad")
    bad_poll = wait_done(client, "bad")
    assert bad_poll.status.failed
    good_poll = wait_done(client, "good")
    assert [r.state for r in good_poll.status.ranks] == ["succeeded", "succeeded"]
    backend.terminate("c")


def test_vanished_rank_is_reported_lost(backend: LocalBackend) -> None:
    client, spec = _gang(backend, "c", 2, "sleep 10000")
    client.launch(spec, "job")
    rank_dir = Path(client.handle.nodes[1].root) / "jobs" / "job" / "1"
    pid = int((rank_dir / "pid").read_text())
    # the wrapper writes pgid as it forks the command's shell, which makes the group with setsid a moment
    # later (seconds on a loaded machine): kill once the group exists, or its command would live on
    deadline = time.monotonic() + 30
    while True:
        text = (rank_dir / "pgid").read_text() if (rank_dir / "pgid").exists() else ""
        try:
            if text.strip():
                os.killpg(int(text), 0)
                break
        except ProcessLookupError:
            pass
        assert time.monotonic() < deadline, "rank 1's process group never appeared"
        time.sleep(0.02)
    os.kill(pid, 9)
    os.killpg(int(text), 9)
    poll = wait_done(client, "job")
    assert poll.status.by_rank(1).state == "lost"
    assert poll.status.by_rank(0).state == "cancelled"
    assert "lost" in poll.status.failure_message()
    backend.terminate("c")


def test_teardown_kills_everything_and_is_idempotent(backend: LocalBackend, sky_home: Path) -> None:
    client, spec = _gang(backend, "c", 3, "sleep 10000")
    client.launch(spec, "job")
    assert processes_under(sky_home)
    assert backend.terminate("c").removed is True
    assert not job_processes(sky_home)
    assert not (sky_home / "local" / "c").exists()
    assert backend.terminate("c").removed is False


def test_teardown_never_kills_a_process_that_reused_a_rank_pid(backend: LocalBackend, tmp_path: Path) -> None:
    client, spec = _gang(backend, "c", 2, "true")
    client.launch(spec, "job")
    wait_done(client, "job")
    bystander = subprocess.Popen(["sleep", "30"], cwd=tmp_path)
    try:
        for rank in (0, 1):
            d = Path(client.handle.nodes[rank].root) / "jobs" / "job" / str(rank)
            (d / "pid").write_text(f"{bystander.pid}\n")  # as if the pid had been reused
        (Path(client.handle.nodes[1].root) / "jobs" / "job" / "1" / "exit").unlink()  # a "lost" rank too
        backend.terminate("c")
        assert bystander.poll() is None  # still alive
    finally:
        bystander.kill()
        bystander.wait()
