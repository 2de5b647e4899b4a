"""Output is bounded and never lost: the watcher's memory whatever ranks print, and setup logs to their end.

The rank trigger runs in a child process (``tests/support/output_watch.py``), so its peak RSS (``VmHWM``)
can be read back. 50 MB of output here: a watcher that kept it would outgrow the bound twice over; figure
10 of ``make bench`` measures the same with 200 MB. ``pytest -s`` prints the measured peaks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from output_watch import RSS_GROWTH_LIMIT_MB, outputs, run_child

#: what a rank prints in the memory tests
SIZE = 50_000_000
OUTPUTS = outputs(SIZE)
PIECE = 64 * 1024  # a logged piece of an over-long line holds at most this much output


def _run_child(sky_home: Path, case: str, runs: list[str], poll_interval: float = 0.5) -> dict[str, Any]:
    result = run_child(sky_home, case, runs, poll_interval)
    print(
        f"\nwatcher peak RSS growth, {case}: {result['peak_growth_mb']} MB "
        f"(RSS before {result['rss_before_mb']} MB), {result['seconds']} s"
    )
    return result


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_the_watcher_memory_stays_bounded_and_nothing_is_lost(sky_home: Path, case: str) -> None:
    r = _run_child(sky_home, case, [OUTPUTS[case] + "; exit 0"])
    assert r["state"] == "succeeded"
    assert r["printed"] == SIZE and r["log_offset"] == r["printed"]
    assert r["peak_growth_mb"] < RSS_GROWTH_LIMIT_MB, r
    # every line the rank ended is logged once but the blank ones; only the pieces of over-long lines
    # carry the marker
    assert r["lines"] - r["marked"] == r["newlines"] + (0 if r["ends_with_newline"] else 1) - r["blank"], r
    assert r["longest"] <= 3 * PIECE, r  # a piece holds at most 64 KiB of output (U+FFFD is 3 bytes)
    if not case.endswith("binary"):  # text: every byte is logged (binary turns into U+FFFD)
        assert r["bytes"] + r["newlines"] == r["printed"], r
    if case.startswith("one "):
        assert r["marked"] == SIZE // PIECE, r
        assert r["longest"] == PIECE and r["last"] == "x" * 100


def test_a_busy_watcher_holds_no_backlog_and_loses_nothing(sky_home: Path) -> None:
    """Rank 0 prints 2.3 million short lines and ends while rank 1 runs on (the poll asks every 50 ms).

    Logging them takes seconds: the polls of that time must not pile up in the watcher (each holds
    a chunk of the log), and the rest it reads while the shared poll asks the same node must all come.
    """
    size = 25_000_000
    short = f"yes 0123456789 | head -c {size}; exit 0"
    r = _run_child(sky_home, "25 MB of 11-byte lines, sibling running", [short, "sleep 10000"], 0.05)
    assert r["state"] == "succeeded"
    assert r["log_offset"] == r["printed"] == size, r
    assert r["lines"] == r["newlines"] + 1 == -(-size // 11), r  # the last line has no newline
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
