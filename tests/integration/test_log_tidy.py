"""What a user reads in a rank task's log: each output line dated when the node printed it (also when read
late), no blank lines, the root cause as one short line (the first error), no raw event dicts in the
triggerer's line.

Real local ranks; the rank trigger runs standalone (the ``dag.test()`` path, the same code as in the
triggerer) with its log calls recorded, so the timestamps it hands to Airflow's logger can be checked.
"""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

from gangs import local_gang, trigger_kwargs, wait_done

from airflow_provider_sky.triggers.gang import ShortEvent, SkyRankTrigger
from unit.test_log_tidy import RUN

#: rank 0 prints four lines 2 s apart (a blank one among them), then fails; rank 1 waits to be cancelled


class Recorder:
    """Stands in for the trigger's structlog logger: keeps (level, text, timestamp or None)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, str | None]] = []

    def _log(self, level: str, msg: str, *args: Any, **kw: Any) -> None:
        self.records.append((level, msg % args if args else msg, kw.get("timestamp")))

    def info(self, msg: str, *args: Any, **kw: Any) -> None:
        self._log("info", msg, *args, **kw)

    def error(self, msg: str, *args: Any, **kw: Any) -> None:
        self._log("error", msg, *args, **kw)

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        self._log("warning", msg, *args, **kw)


def _late_trigger(handle: dict[str, Any], rank: int) -> tuple[Recorder, Any]:
    """A rank trigger started after its rank ended (the triggerer was late): its records and event."""
    trig = SkyRankTrigger(rank=rank, end_from_trigger=True, **trigger_kwargs(handle))
    rec = Recorder()
    trig._log = rec  # LoggingMixin keeps its logger here

    async def first() -> Any:
        async for event in trig.run():
            return event

    return rec, asyncio.run(first())


def test_lines_read_late_carry_the_time_they_were_printed(sky_home: Path) -> None:
    b, client, task = local_gang(sky_home, 2, RUN)
    client.launch(task, "job")
    # watched from the start without a mark, as the job task's launch-side bridge does
    wait_done(client, mark=False)
    rec, _ = _late_trigger(client.handle.to_dict(), 0)
    out = [(text, ts) for _, text, ts in rec.records if text.startswith("step ")]
    assert [t for t, _ in out] == ["step 1", "step 2", "step 3", "step 4"], rec.records
    assert all(ts for _, ts in out), out  # dated from the node's records, not left to the read time
    at = [datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp() for _, ts in out]
    gaps = [b - a for a, b in zip(at, at[1:], strict=False)]
    assert all(1.0 < g < 3.5 for g in gaps), (gaps, out)
    b.terminate("c")


def test_failed_and_cancelled_rank_logs_lead_with_the_root_cause(sky_home: Path) -> None:
    b, client, task = local_gang(sky_home, 2, RUN)
    client.launch(task, "job")
    wait_done(client, mark=False)
    handle = client.handle.to_dict()
    rec, event = _late_trigger(handle, 0)
    texts = [text for _, text, _ in rec.records]
    # no blank line: the rank's `echo` with nothing is not logged as an empty INFO line
    assert all(t.strip() for t in texts), texts
    levels = [lvl for lvl, _, _ in rec.records]
    first_error = texts[levels.index("error")]
    # with the failing rank's last line of output: what it said before it failed
    assert first_error == "root cause: rank 0 (127.1.0.1) exited with code 1; its last output: step 4", texts
    # once, right after the rank's output (the UI orders a log by time: the output's lines come first)
    assert texts.count(first_error) == 1, texts
    assert texts.index(first_error) == texts.index("step 4") + 1, texts
    # what Airflow's triggerer logs for the event ("Trigger fired event ... result=...") is one short line
    assert "{" not in repr(event) and len(repr(event)) < 60, repr(event)
    assert repr(ShortEvent({"kind": "rank", "rank": 3, "state": "failed", "x": 1})) == (
        "TriggerEvent<rank 3: failed>"
    )

    rec1, _ = _late_trigger(handle, 1)
    texts1 = [text for lvl, text, _ in rec1.records if lvl == "error"]
    assert texts1 == [
        "rank 1 cancelled; root cause: rank 0 (127.1.0.1) exited with code 1; its last output: step 4"
    ], rec1.records
    assert any("rank 1 waiting" in t for _, t, _ in rec1.records)
    b.terminate("c")
