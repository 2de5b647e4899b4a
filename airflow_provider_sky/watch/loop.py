"""The watch loop every watcher of a gang runs (triggers' shared poll, launch-side bridge, setup): polls,
fail-fast cancel of the siblings (sent again to ranks it did not reach), lost nodes."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import (
    AsyncGenerator,
)
from dataclasses import dataclass, field

from airflow_provider_sky.model.gang import LOST, RUNNING, cancel_reason
from airflow_provider_sky.watch.jobs import GangClient, Poll

log = logging.getLogger(__name__)


#: seconds past a fail-fast cancel's SIGKILL (``grace``) after which a rank still running is sent it again
RECANCEL_AFTER = 2.0


@dataclass
class MonitorState:
    """What a watcher carries between polls: log offsets and when a node first stopped answering."""

    offsets: dict[int, int] = field(default_factory=dict)
    unreachable_since: dict[int, float] = field(default_factory=dict)
    cancel_issued: bool = False
    #: when each rank was last sent the gang's cancel (fail-fast), to send it again if it lives on
    cancel_sent: dict[int, float] = field(default_factory=dict)
    #: what the backend says of a lost rank's node (asked once per rank)
    lost_why: dict[int, str | None] = field(default_factory=dict)


async def _lost_reason(client: GangClient, rank: int, st: MonitorState) -> str | None:
    """The backend's word on why a lost rank's node is gone (e.g. an EC2 spot interruption), once."""
    if rank not in st.lost_why:
        try:
            st.lost_why[rank] = await asyncio.to_thread(client.backend.lost_reason, client.handle.nodes[rank])
        except Exception as exc:  # the explanation is a courtesy: the rank is lost either way
            log.info("Why rank %s's node is gone could not be asked: %s", rank, exc)
            st.lost_why[rank] = None
    return st.lost_why[rank]


def _cancel_due(poll: Poll, st: MonitorState, grace: float) -> list[int]:
    """The ranks a failed gang's watcher sends its cancel to now: every unfinished rank that answered
    this round and was not sent it yet, or was sent it a while ago and still runs."""
    due = []
    for r in poll.status.ranks:
        if r.terminal or r.rank in poll.unreachable:
            continue
        wait = grace + RECANCEL_AFTER * (3 if r.rank in poll.cancel_seen else 1)
        if poll.at - st.cancel_sent.get(r.rank, -math.inf) > wait:
            due.append(r.rank)
    return due


async def watch(
    client: GangClient,
    job_id: str,
    *,
    poll_interval: float = 0.5,
    fail_fast: bool = True,
    grace: float = 3.0,
    lost_after: float = 10.0,
    state: MonitorState | None = None,
    mark: bool = True,
) -> AsyncGenerator[Poll, None]:
    """Poll a job until every rank is terminal, yielding each :class:`Poll`.

    The gang policy lives here: the first failed or lost rank cancels every unfinished sibling at
    once (that is what makes fail-fast take about a second), and a node that keeps failing to
    answer for ``lost_after`` seconds is reported lost.
    """
    st = state or MonitorState()
    while True:
        poll = await client.apoll(job_id, st.offsets, mark=mark)
        for rank, (off, data) in poll.chunks.items():
            st.offsets[rank] = off + len(data)
        for r in poll.status.ranks:
            if r.rank in poll.unreachable:
                since = st.unreachable_since.setdefault(r.rank, poll.at)
                if poll.at - since >= lost_after:
                    r.state, r.end = LOST, since
                    r.reason = (
                        f"node {r.ip} stopped answering for {lost_after:.0f}s: {poll.unreachable[r.rank]}"
                    )
                    why = await _lost_reason(client, r.rank, st)
                    if why:
                        r.reason += f"; {why}"
                else:
                    r.state = RUNNING
            else:
                st.unreachable_since.pop(r.rank, None)
                if (
                    r.state == LOST
                    and (why := await _lost_reason(client, r.rank, st))
                    and why not in r.reason
                ):
                    r.reason += f"; {why}"  # a node the head's agent found lost (EC2: the instance's end)
        just_cancelled = False
        if fail_fast and poll.status.failed:
            # every rank still running gets the cancel; one that did not answer this round (its call
            # would only hang) gets it when it answers, and one the cancel did not reach (its call
            # failed: an overloaded exec server, a node back from a hang) or that lives on well past
            # the cancel's SIGKILL gets it again
            pending = _cancel_due(poll, st, grace)
            if pending:
                if st.cancel_issued:
                    log.info(
                        "Ranks %s of job %s still run after the cancel; cancelling again", pending, job_id
                    )
                else:
                    log.info("Rank failed; cancelling ranks %s of job %s", pending, job_id)
                st.cancel_sent.update(dict.fromkeys(pending, poll.at))
                # the first one leaves a machine whose failing rank cancels its siblings itself to it;
                # one sent again (a rank lived on past the grace) goes to every rank listed
                await client.acancel(
                    job_id,
                    pending,
                    grace,
                    wait=False,
                    reason=cancel_reason(poll.status),
                    fail_fast=not st.cancel_issued,
                )
            just_cancelled = not st.cancel_issued
            st.cancel_issued = True
            poll.status.cancel_requested = True
        yield poll
        if poll.status.done:
            return
        # right after a cancel, look again soon: SIGTERMed siblings are usually gone within 0.1 s
        await asyncio.sleep(min(poll_interval, 0.1) if just_cancelled else poll_interval)
