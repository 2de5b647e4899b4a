"""The head agent's window of each running rank's log (``agent/node.py``: ``Head.on_tails``, the status
answer's ``chunk``/``behind``): what the agents ship with their heartbeats is what a watcher reads,
in order and once, whatever arrives twice, late, past a gap or from a node that does not own the rank."""

from __future__ import annotations

import base64
from typing import Any

import pytest

from airflow_provider_sky.agent import node
from airflow_provider_sky.agent.client import _rank
from airflow_provider_sky.agent.node import Head, HeadJob, NodeWork


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture
def head() -> Head:
    h = Head("n0", NodeWork("n0", lambda job, recs: None, 0.25), lost_after=10.0, beat=1.0)
    plan = {"n0": {"ranks": [["/r0", 0]]}, "n1": {"ranks": [["/r1", 1], ["/r1", 2]]}}
    h.jobs["j"] = HeadJob("j", plan, orphan_timeout=0.0, now=0.0)
    return h


def _logs(h: Head, offsets: dict[int, int], max_log: int = 1 << 20) -> dict[int, Any]:
    answer = h.status("j", logs_from={str(r): off for r, off in offsets.items()}, max_log=max_log)
    assert answer["ships"] is True
    return {rec["rank"]: _rank(rec) for rec in answer["ranks"]}


def test_shipped_bytes_are_served_from_any_offset_inside_the_window(head: Head) -> None:
    head.on_tails("n1", {"j": {"1": [0, _b64(b"abc")]}})
    head.on_tails("n1", {"j": {"1": [3, _b64(b"def\n")]}})
    got = _logs(head, {1: 2})[1]
    assert got.chunk == (2, b"cdef\n") and got.shipped == 7 and not got.behind
    assert _logs(head, {1: 7})[1].chunk is None  # nothing new: no chunk, not behind
    assert _logs(head, {1: 0}, max_log=2)[1].chunk == (0, b"ab")


def test_bytes_shipped_twice_or_overlapping_are_kept_once(head: Head) -> None:
    head.on_tails("n1", {"j": {"1": [0, _b64(b"abcd")]}})
    head.on_tails("n1", {"j": {"1": [2, _b64(b"cdef")]}})  # a re-ship overlapping the end
    head.on_tails("n1", {"j": {"1": [0, _b64(b"ab")]}})  # old bytes again
    assert _logs(head, {1: 0})[1].chunk == (0, b"abcdef")


def test_after_a_gap_the_window_starts_again_and_a_watcher_before_it_is_behind(head: Head) -> None:
    head.on_tails("n1", {"j": {"1": [0, _b64(b"abc")]}})
    head.on_tails("n1", {"j": {"1": [100, _b64(b"zz")]}})  # the agent skipped ahead (a fast printer)
    behind = _logs(head, {1: 3})[1]
    assert behind.behind and behind.chunk is None and behind.shipped == 102
    assert _logs(head, {1: 100})[1].chunk == (100, b"zz")


def test_the_window_keeps_the_newest_bytes(head: Head, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "HEAD_WINDOW", 8)
    head.on_tails("n1", {"j": {"1": [0, _b64(b"0123456789")]}})
    head.on_tails("n1", {"j": {"1": [10, _b64(b"ab")]}})
    assert _logs(head, {1: 4})[1].chunk == (4, b"456789ab")
    assert _logs(head, {1: 3})[1].behind


def test_a_node_ships_only_its_own_ranks_and_garbage_is_dropped(head: Head) -> None:
    head.on_tails("n0", {"j": {"1": [0, _b64(b"not n0's rank")]}})
    head.on_tails("n1", {"j": {"1": [0, "%%% not base64"]}})
    head.on_tails("n1", {"j": {"2": [-5, _b64(b"x")]}})
    head.on_tails("n1", {"j": {"2": ["0", _b64(b"x")]}, "other-job": {"1": [0, _b64(b"x")]}})
    head.on_tails("n1", ["not", "a", "mapping"])
    head.on_tails("n1", {"j": {"1": [0, _b64(b"ok")]}})
    got = _logs(head, {0: 0, 1: 0, 2: 0})
    assert got[1].chunk == (0, b"ok")
    assert got[0].shipped is None and got[2].shipped is None


def test_one_answer_shares_its_log_budget_in_turns(head: Head, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(node, "STATUS_LOG_MAX", 4)
    head.on_tails("n1", {"j": {"1": [0, _b64(b"1111")], "2": [0, _b64(b"2222")]}})
    first, second = _logs(head, {1: 0, 2: 0}), _logs(head, {1: 0, 2: 0})
    served = [
        {r for r in (1, 2) if first[r].chunk is not None},
        {r for r in (1, 2) if second[r].chunk is not None},
    ]
    assert served in ([{1}, {2}], [{2}, {1}]), served  # the rank left out of one answer leads the next


def test_a_status_without_offsets_carries_no_log_bytes(head: Head) -> None:
    head.on_tails("n1", {"j": {"1": [0, _b64(b"abc")]}})
    answer = head.status("j")
    assert all("chunk" not in rec and "shipped" not in rec for rec in answer["ranks"])


def _work_with_logs(tmp_path: Any, logs: dict[int, bytes]) -> NodeWork:
    work = NodeWork("n1", lambda job, recs: None, 0.25)
    nj = work.add("j", [[str(tmp_path), r] for r in logs], "", 1.0, "")
    for r, data in logs.items():
        d = tmp_path / "jobs" / "j" / str(r)
        d.mkdir(parents=True)
        (d / "log").write_bytes(data)
        nj.recs[r] = {"rank": r, "state": "running"}
    return work


def _shipped(tails: dict[str, Any]) -> dict[int, tuple[int, bytes]]:
    return {int(r): (off, base64.b64decode(b)) for r, (off, b) in tails.get("j", {}).items()}


def test_an_agent_ships_what_grew_since_its_last_beat(tmp_path: Any) -> None:
    work = _work_with_logs(tmp_path, {1: b"one\n", 2: b""})
    assert _shipped(work.log_tails(work.log_sizes())) == {1: (0, b"one\n")}
    assert work.log_tails(work.log_sizes()) == {}  # nothing new
    with open(tmp_path / "jobs" / "j" / "1" / "log", "ab") as f:
        f.write(b"two\n")
    assert _shipped(work.log_tails(work.log_sizes())) == {1: (4, b"two\n")}


def test_a_rank_printing_faster_than_a_beat_ships_its_newest_bytes(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node, "SHIP_RANK", 4)
    work = _work_with_logs(tmp_path, {1: b"0123456789"})
    assert _shipped(work.log_tails(work.log_sizes())) == {
        1: (6, b"6789")
    }  # a gap the watcher reads from the node


def test_ranks_past_a_beats_budget_go_first_at_the_next(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node, "SHIP_BEAT", 4)
    work = _work_with_logs(tmp_path, {1: b"aaaa", 2: b"bbbb"})
    first = _shipped(work.log_tails(work.log_sizes()))
    second = _shipped(work.log_tails(work.log_sizes()))
    assert len(first) == len(second) == 1 and {**first, **second} == {1: (0, b"aaaa"), 2: (0, b"bbbb")}


def test_an_ended_ranks_window_is_dropped(head: Head) -> None:
    head.on_tails("n1", {"j": {"1": [0, _b64(b"abc")], "2": [0, _b64(b"xyz")]}})
    head.on_report("n1", "j", [{"rank": 1, "state": "exited", "code": 0, "log": 3}])
    got = _logs(head, {1: 0, 2: 0})
    assert got[1].shipped is None and got[1].log_size == 3  # read from its node, to its last byte
    assert got[2].chunk == (0, b"xyz")
