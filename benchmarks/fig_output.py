"""Figure 10: the watcher's memory stays bounded whatever a rank prints.

A rank trigger, subscribed as the triggerer does it, watches one local rank printing 200 MB (one line,
100-byte lines, binary) in a child process; the figure is the child's peak RSS growth (``VmHWM`` minus
the RSS before the launch). The integration test (``tests/integration/test_output_bounds.py``) checks
the same bound and that nothing is lost with 50 MB; this is the size the goal was set at.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import TESTS, Row

SIZE = 200_000_000


def run(quick: bool, base: Path, say: Callable[..., Any]) -> list[Row]:
    import sys

    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from output_watch import RSS_GROWTH_LIMIT_MB, outputs, run_child

    rows: list[Row] = []
    for case, cmd in outputs(SIZE).items():
        growth: list[float] = []
        seconds: list[float] = []
        for i in range(1 if quick else 3):
            work = Path(tempfile.mkdtemp(prefix="fig10-", dir=base))
            try:
                home = work / "sky"
                home.mkdir()
                r = run_child(home, case, [cmd + "; exit 0"])
            finally:
                shutil.rmtree(work, ignore_errors=True)
            if r["state"] != "succeeded" or r["printed"] != SIZE or r["log_offset"] != SIZE:
                raise RuntimeError(f"{case}: the rank's output did not all arrive: {r}")
            growth.append(r["peak_growth_mb"])
            seconds.append(r["seconds"])
            say(f"  fig 10 {case}, #{i + 1}: peak RSS growth {r['peak_growth_mb']} MB, {r['seconds']} s")
        rows.append(
            Row(
                f"10 watcher peak RSS growth, rank prints {case}",
                1,
                growth,
                "n",
                f"< {RSS_GROWTH_LIMIT_MB} MB",
                max(growth) < RSS_GROWTH_LIMIT_MB,
                f"launch -> the rank's event {min(seconds):.1f}-{max(seconds):.1f} s; 0.8-1.2 GB before the bound",
            )
        )
    return rows
