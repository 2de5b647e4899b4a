"""Hang detection: a rank alive but silent for ``hang_timeout`` is hung; its stacks go into its
log and the gang fails fast naming the hung ranks. Real processes on the local backend under
``dag.test()`` (the real scheduler and SSH hosts: ``test_airflow_real.py::test_hang``)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from leaks import bridges, job_processes, processes_under

from airflow_provider_sky.model.gang import GangStatus, RankStatus
from airflow_provider_sky.watch.hang import HangWatch, check_hang_timeout, hang_reason
from airflow_provider_sky.watch.jobs import Poll
from integration.test_dag_test import _out, _run, _states, _xcom

HUNG = "hung: no output for 10 s (ranks 1, 3)"


@pytest.fixture(autouse=True)
def _db(airflow_db: Path) -> None:
    """dag.test() needs the metadata DB."""


def test_sky_hang_dumps_the_stacks_and_fails_naming_the_hung_ranks(
    sky_home: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    t0 = time.time()
    dr, tis = _run("sky_hang")
    took = time.time() - t0
    out = _out(capfd)
    assert str(dr.state) == "failed"
    assert _states(tis, "rank") == {0: "failed", 1: "failed", 2: "failed", 3: "failed"}
    assert tis[("gang", -1)].state == "failed" and tis[("down", -1)].state == "success"
    hung = {r: _xcom(dr, "train.rank", "sky_rank", r) for r in (1, 3)}
    for r, summary in hung.items():
        assert summary["state"] == "failed" and summary["reason"] == HUNG, summary
        # silent from its first line on: found within hang_timeout + one poll (+ the dump, the kill)
        ran = summary["end"] - summary["start"]
        print(f"\nrank {r}: hung after its first line, killed {ran:.2f}s after its start (hang_timeout 10 s)")
        assert 10.0 <= ran < 10.0 + 0.5 + 5.0, summary  # the dump and kill take seconds on a loaded machine
    # alive: rank 0 printed every second, rank 2 only touched $SKY_PROGRESS_FILE
    for r in (0, 2):
        summary = _xcom(dr, "train.rank", "sky_rank", r)
        assert summary["state"] == "cancelled" and summary["reason"] == f"cancelled: {HUNG}", summary
    # every rank task says why: the first hung rank to end is the root cause, the other one failed too
    assert re.search(
        r"failed: rank ([13]) \(\S+\) hung: no output for 10 s \(ranks 1, 3\); ranks 0, 2 cancelled; "
        r"rank [13] failed\. Return code list: \['cancelled', 'hung', 'cancelled', 'hung'\]",
        out,
    )
    # the stack dump is in the hung ranks' logs: each thread's state, wchan and kernel stack (root here)
    for r in (1, 3):
        assert f"==== airflow-provider-sky: rank {r} {HUNG}; stack dump of its processes ====" in out
        assert f"==== end of the stack dump of rank {r} ====" in out
    assert re.search(r"thread \d+ \(python3\): state S \(sleeping\), wchan \w+", out), out[-3000:]
    assert "futex" in out  # Python waiting on its lock, in the kernel stack
    assert "stack dump of rank 0" not in out and "stack dump of rank 2" not in out
    print(f"sky_hang under dag.test(): the whole run took {took:.1f}s")
    assert not [p for p in processes_under(sky_home) if "python3" in p[1] or "sleep" in p[1]]
    assert not bridges(sky_home)


def _poll(at: float, sizes: dict[int, int], progress: dict[int, float] | None = None) -> Poll:
    ranks = [
        RankStatus(r, f"10.0.0.{r}", "running", log_size=s, progress=(progress or {}).get(r))
        for r, s in sizes.items()
    ]
    return Poll(GangStatus("j", ranks), at=at)


def test_silence_is_timed_from_the_last_sign_of_life() -> None:
    """Output and progress-file touches reset a rank's timer; unreachable or ended ranks are not judged."""
    hw = HangWatch(10.0)
    assert hw.hung(_poll(0.0, {0: 5, 1: 5, 2: 0})) == []
    assert hw.hung(_poll(6.0, {0: 9, 1: 5, 2: 0}, {2: 100.0})) == []
    p = _poll(10.0, {0: 9, 1: 5, 2: 0}, {2: 100.0})
    p.unreachable[1] = "no answer"
    assert hw.hung(p) == []  # rank 1 is silent 10 s, but its node did not answer: lost_after's to judge
    assert hw.hung(_poll(10.5, {0: 9, 1: 5, 2: 0}, {2: 100.0})) == [1]
    assert hw.hung(_poll(16.0, {0: 9, 1: 5, 2: 0}, {2: 100.0})) == [0, 1, 2]
    done = _poll(17.0, {0: 9, 1: 5, 2: 0})
    done.status.ranks[1].state = "succeeded"
    assert 1 not in hw.hung(done)
    hw.fired = True
    assert hw.hung(_poll(30.0, {0: 9, 1: 5, 2: 0})) == []  # once per gang
    assert HangWatch(0.0).hung(_poll(1e9, {0: 1})) == []  # off


def test_ranks_that_stopped_together_are_named_together() -> None:
    """Ranks 1 and 3 print their last line a moment apart, so the watcher sees rank 3's a poll later:
    when rank 1 is surely silent for the timeout, rank 3 may be too and is named with it; rank 0, which
    printed four seconds after that, is not."""
    hw = HangWatch(10.0)
    assert hw.hung(_poll(0.0, {0: 0, 1: 0, 3: 0})) == []
    assert hw.hung(_poll(1.0, {0: 1, 1: 5, 3: 0})) == []  # rank 1's last line
    assert hw.hung(_poll(2.0, {0: 2, 1: 5, 3: 5})) == []  # rank 3's, printed in (1.0, 2.0]
    assert hw.hung(_poll(6.0, {0: 3, 1: 5, 3: 5})) == []  # rank 0's last line, in (2.0, 6.0]
    assert hw.hung(_poll(10.5, {0: 3, 1: 5, 3: 5})) == []
    assert hw.hung(_poll(11.0, {0: 3, 1: 5, 3: 5})) == [1, 3]


def test_a_rank_that_fell_silent_two_polls_later_is_not_named_yet() -> None:
    """Rank 3's last line comes two polls after rank 1's (ranks that start that far apart on a loaded
    machine): at the verdict rank 3 is surely silent less than the timeout, so only rank 1 is named.
    Why sky_hang's hung ranks print nothing: silent from their start, both are timed from the same poll."""
    hw = HangWatch(10.0)
    assert hw.hung(_poll(0.0, {1: 0, 3: 0})) == []
    assert hw.hung(_poll(0.5, {1: 5, 3: 0})) == []  # rank 1's last line
    assert hw.hung(_poll(1.0, {1: 5, 3: 0})) == []
    assert hw.hung(_poll(1.5, {1: 5, 3: 5})) == []  # rank 3's, printed in (1.0, 1.5]
    assert hw.hung(_poll(10.5, {1: 5, 3: 5})) == [1]
    silent = HangWatch(10.0)  # both silent from the start: named together, whenever each was first seen
    assert silent.hung(_poll(0.0, {1: 0, 3: 0})) == []
    assert silent.hung(_poll(10.0, {1: 0, 3: 0})) == [1, 3]


def test_a_rank_whose_node_missed_the_verdicts_poll_is_named_with_the_others() -> None:
    """Ranks 1 and 3 silent from the start; at the poll that finds rank 3 hung, rank 1's node does not
    answer (a loaded machine: a CI run named rank 3 alone). Rank 1 is judged from the poll before: it may
    have been silent as long, so it is named too; a rank last seen printing 4 s before that poll is
    not."""
    hw = HangWatch(10.0)
    assert hw.hung(_poll(0.0, {1: 0, 3: 0})) == []
    assert hw.hung(_poll(9.0, {1: 0, 3: 0})) == []
    p = _poll(10.0, {1: 0, 3: 0})
    p.unreachable[1] = "timed out"
    assert hw.hung(p) == [1, 3]
    assert hw.silences == {1: (9.0, 1.0), 3: (10.0, 0.0)}  # what the verdict's log line says
    spoke = HangWatch(10.0)
    assert spoke.hung(_poll(0.0, {1: 0, 3: 0})) == []
    assert spoke.hung(_poll(5.0, {1: 5, 3: 0})) == []  # rank 1's last line, in (0.0, 5.0]
    assert spoke.hung(_poll(9.0, {1: 5, 3: 0})) == []
    p = _poll(10.0, {1: 5, 3: 0})
    p.unreachable[1] = "timed out"
    assert spoke.hung(p) == [3]


def test_a_stalled_watcher_names_no_rank_that_spoke_late() -> None:
    """A gap of 9 s between two polls (a paused triggerer) leaves the time of a change that uncertain:
    at most half the timeout of it counts, so a rank that may have printed 6 s ago is not named."""
    hw = HangWatch(10.0)
    assert hw.hung(_poll(0.0, {0: 0, 1: 0})) == []
    assert hw.hung(_poll(1.0, {0: 1, 1: 5})) == []
    assert hw.hung(_poll(10.0, {0: 4, 1: 5})) == []  # rank 0 printed somewhere in (1.0, 10.0]
    assert hw.hung(_poll(11.0, {0: 4, 1: 5})) == [1]
    assert hw.hung(_poll(16.0, {0: 4, 1: 5})) == [0, 1]  # 6 s sure + 5 s doubt: rank 0 now may be hung


def test_reason_names_every_hung_rank() -> None:
    assert hang_reason(600, [3, 1]) == "hung: no output for 600 s (ranks 1, 3)"
    assert hang_reason(90.5, [2]) == "hung: no output for 90.5 s (rank 2)"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("600", "hang_timeout: expected seconds as a number (e.g. 600) or None for off, got '600'"),
        (-1, "hang_timeout: must be a number of seconds from 1 to 2592000 (0 or None: off), got -1"),
        (float("nan"), "hang_timeout: must be a number of seconds from 1 to"),
        (True, "hang_timeout: expected seconds as a number"),
    ],
)
def test_a_bad_hang_timeout_fails_when_the_dag_is_parsed(value: object, error: str) -> None:
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_sky.taskgroup import sky_gang

    assert check_hang_timeout(None) == 0.0 and check_hang_timeout(600) == 600.0
    with pytest.raises(ValueError, match=re.escape(error)):
        with DAG("bad_hang", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
            sky_gang("g", num_nodes=2, run="true", hang_timeout=value)


def test_the_progress_file_is_the_providers_name() -> None:
    from airflow_provider_sky.spec import SpecError, task_from_args

    with pytest.raises(SpecError, match="envs.SKY_PROGRESS_FILE: is set by the provider"):
        task_from_args(num_nodes=1, run="true", envs={"SKY_PROGRESS_FILE": "/tmp/x"})


#: a Python rank whose worker thread waits forever: silent after its first line
HUNG_PYTHON = r"""
import threading, time

def wait_for_the_batch():
    time.sleep(1000)

def train_loop():
    t = threading.Thread(target=wait_for_the_batch, name="data-loader")
    t.start()
    print("training", flush=True)
    t.join()

train_loop()
"""


def test_a_hung_python_rank_gets_a_py_spy_dump_in_its_log(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With py-spy on the node (the dev group installs it next to this Python), a hung Python rank's log
    shows each thread by name with its Python frames, not only kernel stacks."""
    import asyncio
    import shlex
    import shutil
    import sys

    from gangs import local_gang

    from airflow_provider_sky.watch.retry import watch_attempts

    venv_bin = str(Path(sys.executable).parent)
    if not Path(venv_bin, "py-spy").exists():
        pytest.fail("py-spy is missing next to the test's Python: uv sync installs it (dev group)")
    monkeypatch.setenv("PATH", f"{venv_bin}:{shutil.os.environ.get('PATH', '')}")
    script = tmp_path / "train.py"
    script.write_text(HUNG_PYTHON)
    run = f"exec {shlex.quote(sys.executable)} {script}"
    backend, client, task = local_gang(sky_home, 1, run)
    client.launch(task, "job")

    async def go():  # type: ignore[no-untyped-def]
        last = None
        async for poll in watch_attempts(client, "job", poll_interval=0.2, hang_timeout=1.5):
            last = poll
        return last

    final = asyncio.run(asyncio.wait_for(go(), 60))
    assert final.final and final.status.by_rank(0).reason == "hung: no output for 1.5 s (rank 0)"
    log = next(sky_home.glob("local/c/node-0/.sky/jobs/job/0/log")).read_text()
    assert "==== airflow-provider-sky: rank 0 hung: no output for 1.5 s (rank 0); stack dump" in log
    # py-spy's dump: the process, each thread by its Python name, its frames (function, file:line)
    assert re.search(r"Thread \w+ \(\w+\): \"MainThread\"", log), log[-3000:]
    assert re.search(r"Thread \w+ \(\w+\): \"data-loader\"", log), log[-3000:]
    assert re.search(r"wait_for_the_batch \(.*train\.py:\d+\)", log), log[-3000:]
    assert re.search(r"train_loop \(.*train\.py:\d+\)", log), log[-3000:]
    backend.terminate("c")
    assert not job_processes(sky_home)


#: what a hung trainer's command line carries: its token, the job's secret
HF_TOKEN = "hf_s3cr3tT0kenForTheDump42"


@pytest.mark.parametrize("pyspy", [False, True], ids=["proc-fallback", "py-spy"])
def test_a_hung_ranks_command_line_in_the_dump_is_masked_in_its_log_and_task_output(
    sky_home: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, pyspy: bool
) -> None:
    """The dump shows each process's command line (and py-spy's header repeats it): a ``--hf-token``
    argument goes through the rank's output mask like everything else in its log."""
    import asyncio
    import os
    import sys

    from gangs import launched, trigger_kwargs

    from airflow_provider_sky.triggers.gang import SkyGangTrigger, SkyRankTrigger
    from integration.test_triggers import _shared

    venv_bin = str(Path(sys.executable).parent)
    path = [
        p
        for p in os.environ.get("PATH", "").split(os.pathsep)
        if p and Path(p, "py-spy").resolve() != Path(venv_bin, "py-spy").resolve()
    ]
    monkeypatch.setenv("PATH", os.pathsep.join([venv_bin, *path] if pyspy else path))
    run = (
        f'echo "training with a token"; exec {sys.executable} -c '
        "'import threading; threading.Event().wait()' --hf-token \"$HF_TOKEN\""
    )
    b, handle = launched(sky_home, 1, run, secrets={"HF_TOKEN": HF_TOKEN})
    kw = trigger_kwargs(handle, hang_timeout=1.5)
    events = asyncio.run(asyncio.wait_for(_shared([SkyRankTrigger(rank=0, **kw), SkyGangTrigger(**kw)]), 60))
    out = _out(capfd)
    assert events[0]["reason"] == "hung: no output for 1.5 s (rank 0)", events
    log = next(sky_home.glob("local/c/node-0/.sky/jobs/job/0/log")).read_text()
    for text in (log, out):
        assert "stack dump of its processes ====" in text, text[-3000:]
        assert HF_TOKEN not in text, text[-3000:]
        assert "--hf-token ***" in text, text[-3000:]
    if pyspy:
        assert "MainThread" in log, log[-3000:]
    b.terminate("c")
    assert not job_processes(sky_home)


def test_a_hung_rank_that_closed_its_output_gets_a_dump_without_command_lines(sky_home: Path) -> None:
    """Its mask filter has ended (the rank closed stdout and stderr), so nothing could mask a command
    line any more: the dump leaves them out, and still shows each thread."""
    import asyncio
    import sys

    from gangs import local_gang

    from airflow_provider_sky.watch.retry import watch_attempts

    # the rank waits for its filter to end (it ends once the rank closed its output): a filter still
    # starting (a Python start, slow on a loaded machine) would mask the dump, rightly, and show the
    # lines; the verdict after 5 s of silence leaves it that long to start, read the line and end
    run = (
        'echo "closing my output"; exec >/dev/null 2>&1; '
        'while [ ! -e "${SKY_PROVIDER_MARK}filter.done" ]; do sleep 0.05; done; '
        f"exec {sys.executable} -c "
        "'import threading; threading.Event().wait()' --hf-token \"$HF_TOKEN\""
    )
    backend, client, task = local_gang(sky_home, 1, run, secrets={"HF_TOKEN": HF_TOKEN})
    client.launch(task, "job")

    async def go():  # type: ignore[no-untyped-def]
        last = None
        async for poll in watch_attempts(client, "job", poll_interval=0.2, hang_timeout=5):
            last = poll
        return last

    final = asyncio.run(asyncio.wait_for(go(), 60))
    assert final.final and final.status.by_rank(0).reason == "hung: no output for 5 s (rank 0)"
    log = next(sky_home.glob("local/c/node-0/.sky/jobs/job/0/log")).read_text()
    assert "command line not shown (the rank's secrets can no longer be masked)" in log, log[-3000:]
    assert re.search(r"thread \d+ \(python3?\): state S", log), log[-3000:]
    assert HF_TOKEN not in log and "--hf-token" not in log, log[-3000:]
    backend.terminate("c")


def test_a_watcher_leaves_hangs_to_the_clusters_head_agent() -> None:
    """On a cluster with node agents the head times the silences (``agent/node.py``): a watcher whose
    poll says so gives no verdict of its own, however long a rank is silent."""
    hw = HangWatch(10.0)
    for at in (0.0, 11.0, 30.0):
        p = _poll(at, {0: 5, 1: 5})
        p.head_hangs = 10.0
        assert hw.hung(p) == []
    alone = HangWatch(10.0)  # the same polls from a cluster without agents: the watcher's verdict
    assert alone.hung(_poll(0.0, {0: 5, 1: 5})) == [] and alone.hung(_poll(11.0, {0: 5, 1: 5})) == [0, 1]
