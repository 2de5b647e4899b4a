"""The head agent's own verdicts (``agent/node.py``), by its clock, from what the agents report: a hang
(``hang_timeout``: every running rank's log size and progress time from the heartbeats) and a rank its
node stopped without the head's word (that node lost the head). No process: the head's methods are fed
reports and ticks as its server and housekeeping would."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_sky.agent.node import Head, HeadJob, NodeWork, hang_reason


def _head(hang_timeout: float = 0.0) -> Head:
    h = Head("n0", NodeWork("n0", lambda job, recs: None, 0.25), lost_after=10.0, beat=1.0)
    plan = {"n0": {"ranks": [["/r0", 0]]}, "n1": {"ranks": [["/r1", 1]]}, "n2": {"ranks": [["/r2", 2]]}}
    h.jobs["j"] = HeadJob("j", plan, orphan_timeout=0.0, now=0.0, hang_timeout=hang_timeout)
    return h


@pytest.fixture
def hangs(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """The ranks each hang verdict named (the dump and the cancel are the agents' processes)."""
    found: list[list[int]] = []

    def spawn(self: NodeWork, coro: Any) -> None:
        coro.close()

    async def nothing() -> None:
        return None

    def record(self: Head, hj: HeadJob, ranks: list[int]) -> Any:
        found.append(ranks)
        return nothing()

    monkeypatch.setattr(NodeWork, "_spawn", spawn)
    monkeypatch.setattr(Head, "_hang", record)
    return found


def _running(h: Head) -> HeadJob:
    hj = h.jobs["j"]
    for r, node in hj.node_of.items():
        h.on_report(node, "j", [{"rank": r, "state": "running", "log": 0}])
    return hj


def _tick(h: Head, hj: HeadJob, at: float, logs: dict[int, int]) -> None:
    for r, size in logs.items():
        hj.logs[r] = size
    h._hang_check(hj, at)


def test_a_rank_silent_for_hang_timeout_is_hung_and_one_silent_a_beat_less_is_named_too(
    hangs: list[list[int]],
) -> None:
    h = _head(hang_timeout=10.0)
    hj = _running(h)
    _tick(h, hj, 0.0, {0: 5, 1: 5, 2: 5})
    _tick(h, hj, 1.0, {0: 6, 1: 5, 2: 6})  # rank 1 silent from here; ranks 0, 2 print
    _tick(h, hj, 2.0, {0: 7, 1: 5, 2: 7})  # rank 2's last line (it stopped a beat after rank 1)
    for t in range(3, 10):
        _tick(h, hj, float(t), {0: 7 + t, 1: 5, 2: 7})
    assert hangs == []  # rank 1 unchanged since the head first saw it at 0 s: silent 9 s
    _tick(h, hj, 10.0, {0: 20, 1: 5, 2: 7})
    # rank 1 surely silent 10 s; rank 2 unchanged since 2 s (8 s), but its last line may have come up to
    # a check and a heartbeat before: named too
    assert hangs == [[1, 2]]
    _tick(h, hj, 30.0, {0: 20, 1: 5, 2: 7})
    assert hangs == [[1, 2]]  # once


def test_a_rank_that_prints_or_touches_its_progress_file_is_not_hung(hangs: list[list[int]]) -> None:
    h = _head(hang_timeout=10.0)
    hj = _running(h)
    for t in range(0, 40):
        # rank 1 prints nothing but its progress file's mtime moves every 5 s
        _tick(h, hj, float(t), {0: t, 1: [5, 100 + t // 5], 2: t})  # type: ignore[dict-item]
    assert hangs == []


def test_no_hang_timeout_no_verdict_and_ended_ranks_are_not_judged(hangs: list[list[int]]) -> None:
    h = _head(hang_timeout=0.0)
    hj = _running(h)
    for t in range(0, 100, 10):
        _tick(h, hj, float(t), {0: 1, 1: 1, 2: 1})
    assert hangs == []
    h2 = _head(hang_timeout=5.0)
    hj2 = _running(h2)
    h2.on_report("n1", "j", [{"rank": 1, "state": "exited", "code": 0}])
    for t in range(0, 20):
        _tick(h2, hj2, float(t), {0: t, 2: t})
    assert hangs == []


def test_the_hang_reason_is_the_watchers() -> None:
    assert hang_reason(600, [3, 1]) == "hung: no output for 600 s (ranks 1, 3)"
    assert hang_reason(2.5, [0]) == "hung: no output for 2.5 s (rank 0)"


def _decided(h: Head) -> tuple[str, str, Any]:
    hj = h.jobs["j"]
    return hj.state, hj.reason, hj.cancel and hj.cancel["reason"]


@pytest.mark.parametrize(
    ("why", "decides"),
    [
        ("the head node's agent stopped answering for 10s (head node lost)", True),
        ("marked failed by a user", False),  # a per-node cancel: the control plane cancels every node
        ("the cluster is torn down", False),  # a teardown of some nodes leaves the others to it
        ("@rank-failed 2 1", False),  # a sibling's fail-fast on that machine: its own report decides
    ],
)
def test_a_rank_its_node_stopped_for_a_lost_head_stops_the_gang(
    hangs: list[list[int]], why: str, decides: bool
) -> None:
    h = _head()
    _running(h)
    h.on_report("n1", "j", [{"rank": 1, "state": "exited", "code": 143, "why": why}])
    if decides:
        assert _decided(h) == ("failed", why, why)
        assert h.jobs["j"].cause["rank"] == 1  # type: ignore[index]
    else:
        assert _decided(h) == ("running", "", None)


def test_a_head_lost_report_after_the_heads_decision_changes_nothing(hangs: list[list[int]]) -> None:
    h = _head()
    _running(h)
    h.cancel("j", "by the user")
    lost = "the head node's agent stopped answering for 10s (head node lost)"
    h.on_report("n2", "j", [{"rank": 2, "state": "exited", "code": 143, "why": lost}])
    assert _decided(h) == ("cancelled", "by the user", "by the user")
