"""Output is bounded and never lost: the watcher's memory whatever ranks print, and setup logs to their end.

The rank trigger runs in a child process (this file run as a script), so its peak RSS (``VmHWM``) can
be read back. Its logger counts what it is given and formats every message like a real one would
(``%s`` applied), without writing 200 MB anywhere. ``pytest -s`` prints the measured peaks.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

MARKER = " [line continues]"
#: the watcher may grow by this much whatever a rank prints (it grew by 0.2-1.6 GB before)
RSS_GROWTH_LIMIT_MB = 24
#: what a rank prints, 200 MB of it
OUTPUTS = {
    "one 200 MB line": "head -c 200000000 /dev/zero | tr '\\0' x",
    "200 MB of 100-byte lines": "yes " + "0123456789" * 10 + " | head -c 200000000",
    "200 MB of binary": "head -c 200000000 /dev/urandom",
}


def _mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


class _CountingLog:
    """Stands in for the trigger's logger: formats each message, keeps only counts."""

    def __init__(self) -> None:
        self.lines = 0
        self.marked = 0
        self.bytes = 0  # UTF-8 bytes of the lines, markers excluded
        self.longest = 0
        self.last = ""

    def info(self, fmt: str, *args: Any, **kw: Any) -> None:  # kw: the line's timestamp
        text = fmt % args
        self.lines += 1
        if text.endswith(MARKER):
            self.marked += 1
            text = text[: -len(MARKER)]
        size = len(text.encode("utf-8", "surrogatepass"))
        self.bytes += size
        self.longest = max(self.longest, size)
        self.last = text[-100:]

    def warning(self, fmt: str, *args: Any) -> None:
        print("WARNING", fmt % args, file=sys.stderr)


def _child(home: str, case: str, runs: list[str], poll_interval: float) -> dict[str, Any]:
    """Start a gang whose rank 0 prints a lot, watch rank 0 with its trigger, report memory and counts."""
    from airflow.triggers.shared_stream import SharedStreamManager

    from airflow_provider_sky.backends.local import LocalBackend
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.triggers.gang import SkyRankTrigger
    from airflow_provider_sky.watch.jobs import GangClient

    backend = LocalBackend(Path(home))
    run = "; ".join(f'if [ "$SKYPILOT_NODE_RANK" = {r} ]; then {cmd}; fi' for r, cmd in enumerate(runs))
    spec = task_from_args(num_nodes=len(runs), run=run)
    handle = backend.provision("c", spec)
    client = GangClient(backend, handle)
    trigger = SkyRankTrigger(
        rank=0, cluster=handle.to_dict(), job_id="job", sky_conn_id=None, poll_interval=poll_interval
    )
    log = _CountingLog()
    trigger._log = log  # type: ignore[assignment]
    before = _mb("VmRSS")

    async def watch() -> dict[str, Any]:
        # subscribed the way the triggerer does it: the shared poll keeps asking every node meanwhile
        manager = SharedStreamManager()
        key = trigger.shared_stream_key()
        stream = manager.subscribe(trigger_id=1, trigger=trigger, key=key)
        try:
            async for event in trigger.filter_shared_stream(stream):
                return dict(event.payload)
        finally:
            await manager.unsubscribe(1, key)
        raise AssertionError("no event")

    t0 = time.monotonic()
    client.launch(spec, "job")
    event = asyncio.run(watch())
    elapsed = time.monotonic() - t0
    client.cancel("job", grace=0.5)
    log_path = Path(handle.nodes[0].root) / "jobs" / "job" / "0" / "log"
    size, newlines, ends_nl, blank, blank_so_far = 0, 0, False, 0, True
    with open(log_path, "rb") as f:
        while block := f.read(1 << 20):
            size += len(block)
            newlines += block.count(b"\n")
            ends_nl = block.endswith(b"\n")
            parts = block.split(b"\n")
            for i, part in enumerate(parts):  # blank lines (the trigger leaves them out), across blocks
                blank_so_far = blank_so_far and not part.strip(b" \t\r\f\v")
                if i < len(parts) - 1:
                    blank += blank_so_far
                    blank_so_far = True
    if not ends_nl and size and blank_so_far:
        blank += 1  # an unfinished blank last line
    backend.terminate("c")
    return {
        "case": case,
        "rss_before_mb": round(before),
        "peak_growth_mb": round(_mb("VmHWM") - before, 1),
        "seconds": round(elapsed, 1),
        "state": event["state"],
        "log_offset": event["log_offset"],
        "printed": size,
        "newlines": newlines,
        "ends_with_newline": ends_nl,
        "blank": blank,
        "lines": log.lines,
        "marked": log.marked,
        "bytes": log.bytes,
        "longest": log.longest,
        "last": log.last,
    }


def _run_child(sky_home: Path, case: str, runs: list[str], poll_interval: float = 0.5) -> dict[str, Any]:
    """The child's result. Its output goes to files: a process it started must not hold us up."""
    work = sky_home.parent
    result_file, err_file = work / "result.json", work / "child.err"
    with open(err_file, "wb") as err:
        proc = subprocess.run(
            [
                sys.executable,
                __file__,
                str(sky_home),
                case,
                json.dumps(runs),
                str(poll_interval),
                str(result_file),
            ],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            timeout=300,
            check=False,
        )
    assert proc.returncode == 0, err_file.read_text()[-5000:]
    result: dict[str, Any] = json.loads(result_file.read_text())
    print(
        f"\nwatcher peak RSS growth, {case}: {result['peak_growth_mb']} MB "
        f"(RSS before {result['rss_before_mb']} MB), {result['seconds']} s"
    )
    return result


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_the_watcher_memory_stays_bounded_and_nothing_is_lost(sky_home: Path, case: str) -> None:
    r = _run_child(sky_home, case, [OUTPUTS[case] + "; exit 0"])
    assert r["state"] == "succeeded"
    assert r["printed"] == 200_000_000 and r["log_offset"] == r["printed"]
    assert r["peak_growth_mb"] < RSS_GROWTH_LIMIT_MB, r
    # every line the rank ended is logged once but the blank ones; only the pieces of over-long lines
    # carry the marker
    assert r["lines"] - r["marked"] == r["newlines"] + (0 if r["ends_with_newline"] else 1) - r["blank"], r
    assert r["longest"] <= 3 * 64 * 1024, r  # a piece holds at most 64 KiB of output (U+FFFD is 3 bytes)
    if case != "200 MB of binary":  # text: every byte is logged (binary turns into U+FFFD)
        assert r["bytes"] + r["newlines"] == r["printed"], r
    if case == "one 200 MB line":
        assert r["marked"] == 200_000_000 // (64 * 1024), r
        assert r["longest"] == 64 * 1024 and r["last"] == "x" * 100


def test_a_busy_watcher_holds_no_backlog_and_loses_nothing(sky_home: Path) -> None:
    """Rank 0 prints 4.5 million short lines and ends while rank 1 runs on (the poll asks every 50 ms).

    Logging them takes seconds: the polls of that time must not pile up in the watcher (each holds
    a chunk of the log), and the rest it reads while the shared poll asks the same node must all come.
    """
    short = "yes 0123456789 | head -c 50000000; exit 0"
    r = _run_child(sky_home, "50 MB of 11-byte lines, sibling running", [short, "sleep 10000"], 0.05)
    assert r["state"] == "succeeded"
    assert r["log_offset"] == r["printed"] == 50_000_000, r
    assert r["lines"] == r["newlines"] + 1 == 4_545_455, r
    assert r["bytes"] + r["newlines"] == r["printed"], r
    assert r["peak_growth_mb"] < RSS_GROWTH_LIMIT_MB, r


# -- setup: read to the end, the real last lines ------------------------------------------------------


def _setup(sky_home: Path, setup: str, n: int = 2) -> tuple[list[tuple[int, str]], str | None]:
    """Run ``setup`` on ``n`` local nodes through the hook; (every logged line, the failure or None)."""
    from airflow_provider_sky.hooks.sky import SkyHook
    from airflow_provider_sky.spec import task_from_args
    from airflow_provider_sky.watch.setup_stage import SetupFailed, run_setup

    hook = SkyHook(None)
    spec = task_from_args(num_nodes=n, setup=setup, run="true")
    handle = hook.provision("c", spec)
    logged: list[tuple[int, str]] = []
    failure = None
    try:
        run_setup(
            hook.client(handle),
            spec,
            "setup-job",
            on_log=lambda rank, line: logged.append((rank, line)),
            grace=0.5,
        )
    except SetupFailed as exc:
        failure = str(exc)
    finally:
        hook.teardown("c")
    return logged, failure


def test_a_failed_setup_quotes_the_real_last_lines(sky_home: Path) -> None:
    setup = (
        'if [ "$SKYPILOT_SETUP_NODE_RANK" = 1 ]; then seq -f "setup line %g of rank one" 1 40000; '
        "echo LAST-LINE; exit 3; fi; sleep 10000"
    )
    logged, failure = _setup(sky_home, setup)
    assert failure is not None
    assert "rank 1 (" in failure and "exit code 3" in failure
    assert "Setup stopped on ranks [0]" in failure
    tail = failure.split("--- last lines of rank 1's setup log ---\n", 1)[1].splitlines()
    assert tail[-1] == "LAST-LINE"
    assert tail[-2] == "setup line 40000 of rank one"
    assert [line for rank, line in logged if rank == 1] == [
        *(f"setup line {i} of rank one" for i in range(1, 40001)),
        "LAST-LINE",
    ]


def test_a_setup_that_failed_silently_says_no_output(sky_home: Path) -> None:
    _, failure = _setup(sky_home, 'if [ "$SKYPILOT_SETUP_NODE_RANK" = 1 ]; then exit 5; fi; sleep 10000')
    assert failure is not None and "exit code 5" in failure
    assert failure.endswith("--- last lines of rank 1's setup log ---\n(no output)"), failure


def test_every_line_of_a_long_setup_reaches_the_log(sky_home: Path) -> None:
    """1 MB per node, printed faster than one poll reads: every line arrives, whole and in order."""
    setup = 'seq -f "setup line %g of rank $SKYPILOT_SETUP_NODE_RANK" 1 40000; printf "no newline at the end"'
    logged, failure = _setup(sky_home, setup)
    assert failure is None
    for rank in (0, 1):
        assert [line for r, line in logged if r == rank] == [
            *(f"setup line {i} of rank {rank}" for i in range(1, 40001)),
            "no newline at the end",
        ]


if __name__ == "__main__":  # the child of the memory tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("SKY_PROVIDER_HOME", sys.argv[1])
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it is
    out = _child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]))
    Path(sys.argv[5]).write_text(json.dumps(out))
