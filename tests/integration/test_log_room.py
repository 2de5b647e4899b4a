"""The rank triggers never block the triggerer's event loop on a full log channel.

In a child process whose logging is set up exactly as Airflow sets up the trigger runner's (JSON lines
over a socket its supervisor drains), the channel holds a backlog nobody reads, as while the supervisor
sends the runner a big message. 64 real ranks print and end at once; every rank trigger logs output and
end lines. Written straight away, those writes would block the loop until the channel is drained (in the
triggerer: for good, the supervisor waiting on the loop). The loop must keep running, and once the
channel is drained every rank's lines must arrive.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

N = 64
#: how long the channel stays undrained: a loop blocked on it stops for most of that
DRAIN_AFTER = 5.0
#: the longest the loop may stop before the drain: its ticks come every 0.02 s, yet on a 2-core machine
#: loaded 15-30 times over a process waits for the CPU up to ~1.1 s (seen once at 1.07 s); a loop blocked
#: on the channel stops ~4-5 s. 2 s is ~2x either way.
LONGEST_GAP = 2.0


def _fill_until_full(sock: socket.socket) -> int:
    """Write filler lines until the socket no longer polls writable (its backlog is what a busy
    supervisor leaves); returns the bytes written."""
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLOUT)
    line, written = b'{"event": "filler", "level": "info"}\n', 0
    while poller.poll(0):
        written += sock.send(line)
    sock.setblocking(True)  # as Airflow's is (the flag is the descriptor's, shared with the log's dup)
    return written


def _child(home: str, result_file: str) -> None:
    from airflow.sdk.execution_time.supervisor import _configure_logs_over_json_channel
    from airflow.triggers.shared_stream import SharedStreamManager
    from gangs import launched, trigger_kwargs

    from airflow_provider_sky.triggers.gang import SkyGangTrigger, SkyRankTrigger

    runs = (
        'for i in 1 2 3; do echo "rank $SKYPILOT_NODE_RANK says $i"; done; '
        'if [ "$SKYPILOT_NODE_RANK" = 5 ]; then sleep 1; exit 7; fi; sleep 10000'
    )
    b, handle = launched(Path(home), N, runs)
    ours, theirs = socket.socketpair()
    _configure_logs_over_json_channel(os.dup(ours.fileno()))  # the trigger runner's logging
    filled = _fill_until_full(ours)
    kw = trigger_kwargs(handle, end_from_trigger=True)
    triggers: list[Any] = [SkyRankTrigger(rank=r, **kw) for r in range(N)] + [SkyGangTrigger(**kw)]

    received = bytearray()
    drain = threading.Event()

    def drainer() -> None:
        drain.wait()
        theirs.settimeout(1.0)
        while True:
            try:
                data = theirs.recv(1 << 16)
            except TimeoutError:
                if drain.is_set() and stop.is_set():
                    return
                continue
            received.extend(data)

    stop = threading.Event()
    reader = threading.Thread(target=drainer, daemon=True)
    reader.start()

    async def subscribe(manager: SharedStreamManager, i: int, trig: Any) -> str:
        key = trig.shared_stream_key()
        stream = manager.subscribe(trigger_id=i, trigger=trig, key=key)
        try:
            async for event in trig.filter_shared_stream(stream):
                return type(event).__name__
            raise AssertionError("no event")
        finally:
            await manager.unsubscribe(i, key)

    async def main() -> dict[str, Any]:
        gaps: list[tuple[float, float]] = []  # (when, how long the loop did not run)
        t0 = time.monotonic()
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.02)
                now = time.monotonic()
                gaps.append((now - t0, now - last))
                last = now

        async def release() -> None:
            await asyncio.sleep(DRAIN_AFTER)
            drain.set()

        tick, rel = asyncio.ensure_future(ticker()), asyncio.ensure_future(release())
        manager = SharedStreamManager()
        events = await asyncio.gather(*(subscribe(manager, i, t) for i, t in enumerate(triggers)))
        done.set()
        await asyncio.gather(tick, rel)
        undrained = max((gap for at, gap in gaps if at <= DRAIN_AFTER), default=0.0)
        return {"events": events, "longest_gap_before_drain": undrained, "ended_at": time.monotonic() - t0}

    result = asyncio.run(main())
    time.sleep(0.5)
    stop.set()
    reader.join(timeout=10)
    b.terminate("c")
    records = [json.loads(line) for line in bytes(received).splitlines() if line.strip()]
    result["filled"] = filled
    result["events_logged"] = [str(r.get("event")) for r in records if r.get("event") != "filler"]
    Path(result_file).write_text(json.dumps(result))


def test_a_full_log_channel_does_not_stop_the_triggers(sky_home: Path) -> None:
    work = sky_home.parent
    result_file, err_file = work / "result.json", work / "child.err"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "support"), *sys.path]),
    }
    with open(err_file, "wb") as err:
        proc = subprocess.run(
            [sys.executable, __file__, str(sky_home), str(result_file)],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            timeout=60,  # a blocked loop never releases the channel: the child hangs
            check=False,
            env=env,
        )
    assert proc.returncode == 0, err_file.read_text()[-5000:]
    r = json.loads(result_file.read_text())
    assert r["filled"] > 0
    # the loop ran on while nobody drained the channel (written straight away: blocked ~DRAIN_AFTER)
    assert r["longest_gap_before_drain"] < LONGEST_GAP, r["longest_gap_before_drain"]
    assert r["events"] == ["TaskFailedEvent"] * (N + 1)
    assert r["ended_at"] >= DRAIN_AFTER  # they had lines to write: they waited for room
    logged = r["events_logged"]
    for rank in range(N):
        assert any(line.startswith(f"rank {rank} (") for line in logged), rank
        assert f"rank {rank} says 3" in logged, rank
    assert any("exit code 7" in line or "exited with code 7" in line for line in logged)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
