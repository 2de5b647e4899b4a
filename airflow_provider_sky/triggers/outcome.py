"""What a gang's watchers say when it ends: the root cause in one short line, each rank's outcome, the
whole gang's story. Pure text from a poll or an event (no I/O), shared by the triggers and the operators."""

from __future__ import annotations

from typing import Any

from airflow_provider_sky.model.gang import HUNG_PREFIX, LOST, SUCCEEDED, GangStatus, RankStatus, ranks_text
from airflow_provider_sky.watch.retry import GangPoll


def cancel_text(poll: GangPoll) -> str:
    """Why a gang with no failed rank was cancelled: whoever cancelled it said why (``on_kill``)."""
    status = poll.status
    reason = status.cancel_reason or "a task watching it was marked failed or cleared by a user"
    return poll.failure_message or f"Job {status.job_id} was cancelled from Airflow: {reason}"


def cause_text(cause: RankStatus) -> str:
    """What the root-cause rank did, in a few words (as ``GangStatus.failure_message`` says it)."""
    if cause.state == LOST:
        return f"rank {cause.rank} ({cause.ip}) was lost: {cause.reason}"
    if cause.reason.startswith(HUNG_PREFIX):
        return f"rank {cause.rank} ({cause.ip}) {cause.reason}"
    text = f"rank {cause.rank} ({cause.ip}) exited with code {cause.exit_code}"
    return text + (f": {cause.reason}" if cause.reason != f"exited with code {cause.exit_code}" else "")


def root_cause_line(
    status: GangStatus, st: RankStatus, cause: RankStatus | None = None, last_line: str = ""
) -> str:
    """The one short line a failed or cancelled rank's log leads its outcome with: the root cause
    (``cause``: ``status.root_cause()``, when the caller has it already) and its last line of output."""
    if st.state == SUCCEEDED:
        return ""
    cause = cause or status.root_cause()
    if cause is None:
        reason = status.cancel_reason or st.reason
        return f"rank {st.rank} {st.state}: {reason}"[:300]
    mine = "" if cause.rank == st.rank else f"rank {st.rank} {st.state}; "
    said = f"; its last output: {last_line}" if last_line else ""
    return f"{mine}root cause: {cause_text(cause)}{said}"[:300]


def rank_outcome(event: dict[str, Any]) -> str:
    """One log line: the rank's state, exit code, reason and how long it ran."""
    duration = event.get("duration")
    return (
        f"rank {event['rank']} ({event['ip']}): {event['state']}, exit code {event['exit_code']}, "
        f"{event['reason']}" + (f", {duration:.1f}s" if duration else "")
    )


def rank_end_lines(event: dict[str, Any]) -> list[tuple[str, str]]:
    """A rank task's last log lines as (level, text): the short root cause first, then the outcome,
    then the whole gang's story (the long message)."""
    if event["state"] == SUCCEEDED:
        return [("info", rank_outcome(event))]
    out = [("error", event["headline"])] if event.get("headline") else []
    out.append(("info", rank_outcome(event)))
    if event.get("message") and event["message"] != event.get("headline"):
        out.append(("error" if not out else "info", event["message"]))
    return out


def rank_summary(event: dict[str, Any]) -> dict[str, Any]:
    """What a rank task returns and pushes as ``sky_rank``: its outcome, readable back from Airflow (with
    every attempt's when the gang was retried)."""
    out = {k: event.get(k) for k in ("rank", "ip", "state", "exit_code", "reason", "start", "end")}
    cause = event.get("root_cause") or {}
    if event.get("cause_tail") and cause.get("rank") == event.get("rank"):
        out["last_output"] = list(event["cause_tail"])  # the failing rank's own last lines (masked)
    if len(event.get("attempts") or ()) > 1:
        out["attempt"], out["attempts"] = event.get("attempt"), event["attempts"]
    return out


def attempt_boundary(poll: GangPoll, attempt: int) -> str:
    """The line between two attempts in a rank's log: which attempt starts and why."""
    why = next((h["why"] for h in poll.history if h["attempt"] == attempt - 1), "")
    return f"==== attempt {attempt}/{poll.max_attempts}: {why} ===="


#: a gang of more ranks than this says its outcome a line per group of ranks that ended alike
PER_RANK_LINES = 64


def gang_outcome(event: dict[str, Any]) -> list[str]:
    """The gang sensor's log: a line per rank (state, exit code, reason); past :data:`PER_RANK_LINES`
    ranks, a line per outcome shared by several ranks (``ranks 0-511, 513-1023: cancelled, ...``) and a
    line per rank whose outcome is its own. In the triggerer these lines go out in one step to a pipe its
    supervisor drains: 1,024 of them (~100 KB) filled it while the supervisor was busy."""
    ranks = (event.get("gang") or {}).get("ranks", [])
    if len(ranks) <= PER_RANK_LINES:
        return [rank_outcome(r) for r in ranks]
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in ranks:
        groups.setdefault((str(r["state"]), str(r["exit_code"]), str(r["reason"])), []).append(r)
    return [
        rank_outcome(members[0])
        if len(members) == 1
        else f"{ranks_text(r['rank'] for r in members)} ({len(members)}): {state}, exit code {code}, {reason}"
        for (state, code, reason), members in groups.items()
    ]
