"""A gang's watcher dies between attempts: the process that runs the attempts loop is
SIGKILLed, as a worker or a triggerer dies, and a new one takes over. Real processes on the local
backend; the loop (``retry.watch_attempts``) is what the triggers' shared poll and the launch-side bridge
run, so this is the hook/retry level, not a real scheduler.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from gangs import local_gang
from leaks import job_processes

from airflow_provider_sky.backends.local import LocalBackend

pytestmark = pytest.mark.cluster_lane  # see setup.cfg

WATCHER = Path(__file__).resolve().parents[1] / "support" / "retry_watcher.py"
DELAY = 6.0
#: the delay of the test that kills a watcher within it: long beside the rest of it that the new watcher
#: waits (4 s), so that the two differ by more than a loaded machine makes a watcher late
LONG_DELAY = 20.0


def _run(starts: Path, long: float) -> str:
    """Each start of a rank appends one line to ``starts``; attempt 1's rank 1 fails, later ones succeed."""
    return (
        f'echo "$SKYPILOT_NODE_RANK $SKY_ATTEMPT" >> {starts}; '
        'if [ "$SKY_ATTEMPT" = 1 ] && [ "$SKYPILOT_NODE_RANK" = 1 ]; then sleep 0.3; exit 1; fi; '
        f'if [ "$SKY_ATTEMPT" = 1 ]; then sleep 1000; fi; sleep {long}; echo done'
    )


def _watcher(sky_home: Path, delay: float = DELAY) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WATCHER), str(sky_home), "c", "job", "2", str(delay)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(WATCHER.parent)},
    )


def _wait_for(check, timeout: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _kill(proc: subprocess.Popen[str]) -> str:
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate(timeout=10)
    return out


def _finish(proc: subprocess.Popen[str], timeout: float = 90) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-3000:]
    return out


def _starts(starts: Path) -> Counter[tuple[str, str]]:
    return Counter(tuple(line.split()) for line in starts.read_text().splitlines())  # type: ignore[misc]


def _launch_and_watch(
    sky_home: Path, run_for: float, delay: float = DELAY
) -> tuple[Path, LocalBackend, subprocess.Popen[str]]:
    """Job ``job`` on a 2-node gang (rank 1 fails attempt 1) and its first watcher; the starts file."""
    starts = sky_home / "starts"
    backend, client, task = local_gang(sky_home, 2, _run(starts, run_for))
    client.keep_secrets = True
    client.launch(task, "job")
    return starts, backend, _watcher(sky_home, delay)


def test_a_watcher_killed_in_the_retry_delay_resumes_it_and_starts_attempt_2_once(sky_home: Path) -> None:
    starts, backend, first = _launch_and_watch(sky_home, 0.5, LONG_DELAY)
    # attempt 1 failed and the delay began: its due time is on the nodes
    due_files = _wait_for(lambda: list(sky_home.glob("local/c/node-*/.sky/jobs/job/*/due.2")), 30, "due.2")
    due = float(due_files[0].read_text())
    time.sleep(max(0.0, due - 4 - time.time()))
    out = _kill(first)  # killed 4 s before the delay ends, before attempt 2
    assert not list(sky_home.glob("local/c/node-*/.sky/jobs/job.a2")), out
    started_at = time.time()
    second = _watcher(sky_home, LONG_DELAY)
    out = _finish(second)
    assert out.strip().splitlines()[-1] == "attempt 2 final 1 succeeded", out[-2000:]
    a2 = [float((p / "start").read_text()) for p in sky_home.glob("local/c/node-*/.sky/jobs/job.a2/[0-9]*")]
    assert len(a2) == 2
    # the new watcher waited out the rest of the delay (about 4 s), not a whole one of its own (20 s from
    # its start): 8 s of margin for its start and polls on a loaded machine (2.6 s late seen in CI)
    assert min(a2) >= due - 0.05, (a2, due)
    assert max(a2) < started_at + LONG_DELAY - 8, (a2, started_at, due)
    assert _starts(starts) == {("0", "1"): 1, ("1", "1"): 1, ("0", "2"): 1, ("1", "2"): 1}
    backend.terminate("c")
    assert not job_processes(sky_home)


def test_a_watcher_killed_after_attempt_2_started_is_followed_not_doubled(sky_home: Path) -> None:
    starts, backend, first = _launch_and_watch(sky_home, 3.0)
    _wait_for(lambda: len(list(sky_home.glob("local/c/node-*/.sky/jobs/job.a2/*/pid"))) == 2, 40, "attempt 2")
    out = _kill(first)  # attempt 2 runs; its watcher is gone
    assert "attempt 2" not in out or "final 1" not in out
    second = _watcher(sky_home)
    out = _finish(second)
    assert out.strip().splitlines()[-1] == "attempt 2 final 1 succeeded", out[-2000:]
    assert _starts(starts) == {("0", "1"): 1, ("1", "1"): 1, ("0", "2"): 1, ("1", "2"): 1}
    assert not list(sky_home.glob("local/c/node-*/.sky/jobs/job.a3"))
    backend.terminate("c")
    assert not job_processes(sky_home)


@pytest.fixture(autouse=True)
def _no_stray_watchers() -> None:
    """Nothing here needs Airflow's DB; the watcher processes are the test's own and end in it."""
