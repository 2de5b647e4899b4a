"""A rank trigger watching a rank that prints a lot, in a child process whose peak RSS can be read.

Shared by the integration test of bounded output (``tests/integration/test_output_bounds.py``, 50 MB) and
figure 10 of ``make bench`` (200 MB). The child runs this file as a script; its logger counts what it is
given and formats every message like a real one would (``%s`` applied), without writing it anywhere.
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

MARKER = " [line continues]"
#: the watcher may grow by this much whatever a rank prints (it grew by 0.2-1.6 GB before)
RSS_GROWTH_LIMIT_MB = 24


def outputs(size: int) -> dict[str, str]:
    """What a rank prints, ``size`` bytes of it: one line, 100-byte lines, binary."""
    mb = f"{size // 1_000_000} MB"
    return {
        f"one {mb} line": f"head -c {size} /dev/zero | tr '\\0' x",
        f"{mb} of 100-byte lines": "yes " + "0123456789" * 10 + f" | head -c {size}",
        f"{mb} of binary": f"head -c {size} /dev/urandom",
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


def run_child(sky_home: Path, case: str, runs: list[str], poll_interval: float = 0.5) -> dict[str, Any]:
    """The child's result (``sky_home``: its provider home; its parent, a work directory). Its output
    goes to files: a process it started must not hold us up."""
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
    return result


if __name__ == "__main__":  # the child
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    os.environ.setdefault("SKY_PROVIDER_HOME", sys.argv[1])
    faulthandler.dump_traceback_later(240, exit=True)  # a hang shows where it is
    out = _child(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]))
    Path(sys.argv[5]).write_text(json.dumps(out))
