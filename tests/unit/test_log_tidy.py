"""What a user reads in a rank task's log: each output line dated when the node printed it (also when read
late), no blank lines, the root cause as one short line (the first error), no raw event dicts in the
triggerer's line.

Real local ranks; the rank trigger runs standalone (the ``dag.test()`` path, the same code as in the
triggerer) with its log calls recorded, so the timestamps it hands to Airflow's logger can be checked.
"""

from __future__ import annotations

import random
from typing import Any

from airflow_provider_sky.model.logtext import LINE_MARKER, LineClock, LineSplitter

#: rank 0 prints four lines 2 s apart (a blank one among them), then fails; rank 1 waits to be cancelled
RUN = """\
if [ "$SKYPILOT_NODE_RANK" = 0 ]; then
  echo "step 1"; sleep 2; echo "step 2"; echo; sleep 2; echo "step 3"; sleep 2; echo "step 4"; exit 1
fi
echo "rank $SKYPILOT_NODE_RANK waiting"; sleep 10000
"""


def test_line_offsets_survive_any_chunking() -> None:
    """Each line's log offset (what dates it) is right however the log is cut into reads."""
    rnd = random.Random(7)
    lines = [b"a" * rnd.choice([0, 1, 5, 40, 130]) + "é".encode() for _ in range(200)]
    data = b"\n".join(lines) + b"\nlast without newline"
    expected: list[tuple[int, str]] = []
    pos = 0
    for raw in [*lines, b"last without newline"]:
        text = raw.decode()
        while len(raw) > 64:  # the splitter's limit below: pieces with the marker
            cut = 64 if not 0x80 <= raw[64] < 0xC0 else 63
            expected.append((pos, raw[:cut].decode() + LINE_MARKER))
            pos, raw = pos + cut, raw[cut:]
            text = raw.decode()
        expected.append((pos, text))
        pos += len(raw) + 1
    for _ in range(20):
        sp = LineSplitter(limit=64, offset=0)
        got: list[tuple[int, str]] = []
        i = 0
        while i < len(data):
            n = rnd.randint(1, 90)
            got += sp.feed_at(data[i : i + n])
            i += n
        got += sp.flush_at()
        assert got == expected


def test_line_clock_takes_the_earliest_time_that_covers_an_offset() -> None:
    clock = LineClock()
    clock.add(10, 100.0)
    clock.add(30, 102.0)
    clock.add(20, 103.0)  # a second watcher, late: bytes 10..20 were already there at 102
    assert clock.time_of(0) == 100.0
    assert clock.time_of(9) == 100.0
    assert clock.time_of(10) == 102.0
    assert clock.time_of(25) == 102.0
    assert clock.time_of(30) is None  # not seen by any poll yet: dated when read
    clock.forget_before(12)
    assert clock.time_of(12) == 102.0


def test_a_big_gangs_sensor_log_says_its_outcome_in_a_few_lines() -> None:
    """1,024 ranks: the failing rank on a line of its own with its address, the 1,023 cancelled ones on
    one line with their ranks as ranges (a line per rank was ~100 KB written in one step in the
    triggerer); a small gang still gets a line per rank."""
    from airflow_provider_sky.model.gang import GangStatus, RankStatus
    from airflow_provider_sky.triggers.outcome import gang_outcome

    def event(n: int, failing: int) -> dict[str, Any]:
        why = f"cancelled: rank {failing} failed first: exited with code 3"
        ranks = [
            RankStatus(r, f"127.1.{r // 254}.{r % 254 + 1}", "failed", 3, reason="exited with code 3")
            if r == failing
            else RankStatus(r, f"127.1.{r // 254}.{r % 254 + 1}", "cancelled", 143, reason=why)
            for r in range(n)
        ]
        return {"kind": "gang", "state": "failed", "gang": GangStatus("job", ranks).to_dict()}

    big = gang_outcome(event(1024, 512))
    assert big == [
        "ranks 0-511, 513-1023 (1023): cancelled, exit code 143, cancelled: rank 512 failed first: "
        "exited with code 3",
        "rank 512 (127.1.2.5): failed, exit code 3, exited with code 3",
    ]
    small = gang_outcome(event(4, 2))
    assert small[2] == "rank 2 (127.1.0.3): failed, exit code 3, exited with code 3"
    assert len(small) == 4 and small[0].startswith("rank 0 (127.1.0.1): cancelled, exit code 143")
