"""Hang detection: a rank alive but silent for ``hang_timeout`` seconds is hung; its stacks are dumped
into its log, then the gang fails fast with "hung: no output for 600 s (ranks 1, 3)".

Why here and not in the rank tasks: like fail-fast, the decision runs in the shared poll (the triggers'
and the bridge's :func:`watch.watch`), which already reads every rank's log size each interval, so hang
detection costs no extra remote call until a rank is found hung. A sign of life is any new log byte,
or a newer mtime of the rank's progress file (``$SKY_PROGRESS_FILE``, for ranks that print little).
Silence is timed by the watcher's own clock from its first poll of the rank (no clock comparison
between machines): a watcher that starts later (a triggerer restart) counts from then.

On a cluster with node agents the head's agent finds hangs itself (``agent/node.py``: the heartbeats
carry each running rank's log size and progress time), dumps the stacks with the same script and fails
the gang, with or without a watcher; the watchers then leave hangs to it (``Poll.head_hangs``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.agent import node
from airflow_provider_sky.agent.node import hang_reason as hang_reason
from airflow_provider_sky.node.runtime import check_job_id
from airflow_provider_sky.node.shell import DUMP_SCRIPT
from airflow_provider_sky.spec.timing import check_timing
from airflow_provider_sky.watch.jobs import GangClient, Poll, fan_out
from airflow_provider_sky.watch.loop import MonitorState, watch

log = logging.getLogger(__name__)

#: the env var naming a rank's progress file (touch it to show the rank is alive without printing)
PROGRESS_ENV = "SKY_PROGRESS_FILE"
#: seconds a stack dump may take on one node (py-spy attaches to each process)
DUMP_TIMEOUT = node.DUMP_TIMEOUT


def check_hang_timeout(value: Any) -> float:
    """``hang_timeout`` as seconds (0: off), or a SpecError (a ValueError) naming the field: checked
    when the DAG is parsed, so a typo never reaches a provisioned cluster (see :mod:`timing`)."""
    return float(check_timing(hang_timeout=value)["hang_timeout"] or 0.0)


@dataclass
class HangWatch:
    """Per rank: its last sign of life (log size, progress mtime) and when this watcher saw it change."""

    timeout: float
    seen: dict[int, tuple[int, float | None]] = field(default_factory=dict)
    #: when this watcher first saw a rank's current sign (its silence is at least ``now - since``)
    since: dict[int, float] = field(default_factory=dict)
    #: the poll before that one: the sign changed after it (its silence is less than ``now - before``)
    before: dict[int, float] = field(default_factory=dict)
    #: the last poll that read the rank (its node answered)
    looked: dict[int, float] = field(default_factory=dict)
    last_at: float | None = None
    fired: bool = False
    #: at the verdict, each running rank's (sure silence, its uncertainty) in seconds: logged by fire()
    silences: dict[int, tuple[float, float]] = field(default_factory=dict)

    def hung(self, poll: Poll) -> list[int]:
        """The ranks silent for ``timeout`` seconds at this poll (none once the gang is cancelled).

        A rank is found hung once it is surely silent that long (``now - since``). When one is, the
        verdict also names every rank that may have been silent as long: its last sign came between two
        polls, so two ranks that stopped together can be seen a poll apart (a loaded watcher, ranks that
        print their last line a moment apart); that uncertainty counts up to half the timeout. A rank
        whose node did not answer this poll is judged from the last poll that read it, the time since
        then added to its uncertainty: it can be named beside a surely hung one, never on its own."""
        if self.fired or not self.timeout or poll.status.cancel_requested or poll.status.failed:
            return []
        if poll.head_hangs:  # the cluster's head agent times the silences and gives the verdict
            return []
        sure, maybe = [], []
        silences: dict[int, tuple[float, float]] = {}
        prev, self.last_at = self.last_at, poll.at
        for r in poll.status.ranks:
            if r.terminal:
                continue
            answered = r.rank not in poll.unreachable  # else lost_after's to judge; a verdict may name it
            if answered:
                self.looked[r.rank] = poll.at
                sign = (r.log_size, r.progress)
                if self.seen.get(r.rank) != sign:
                    self.seen[r.rank], self.since[r.rank] = sign, poll.at
                    self.before[r.rank] = poll.at if prev is None else prev
            elif r.rank not in self.looked:
                continue
            # surely silent up to the last poll that read it; maybe since the poll before its last sign,
            # and since that last read
            looked, since = self.looked[r.rank], self.since[r.rank]
            silent = looked - since
            doubt = min(since - self.before[r.rank] + poll.at - looked, self.timeout / 2)
            silences[r.rank] = (silent, doubt)
            if answered and silent >= self.timeout:
                sure.append(r.rank)
            elif silent + doubt >= self.timeout:
                maybe.append(r.rank)
        if sure:
            self.silences = silences
        return sorted(sure + maybe) if sure else []

    async def fire(self, client: GangClient, job_id: str, poll: Poll, ranks: list[int], grace: float) -> None:
        """Dump the hung ranks' stacks into their logs, then cancel every rank still running."""
        self.fired = True
        reason = hang_reason(self.timeout, ranks)
        log.warning("Job %s: %s; dumping their stacks, then cancelling the gang", job_id, reason)
        log.info(
            "Job %s: silent (+ up to) at the verdict: %s",
            job_id,
            ", ".join(f"rank {r} {s:.1f}s (+{d:.1f}s)" for r, (s, d) in sorted(self.silences.items())),
        )
        await dump_stacks(client, job_id, ranks, reason)
        # the whole gang (a rank that ended is left as it is): on a cluster with node agents that is one
        # call, and the head's verdict is this reason before it sees a hung rank's SIGTERM exit
        await client.acancel(job_id, None, grace, wait=False, reason=reason)
        poll.status.cancel_requested = True
        poll.status.cancel_reason = reason


async def dump_stacks(client: GangClient, job_id: str, ranks: Sequence[int], reason: str) -> None:
    """Run :data:`DUMP_SCRIPT` on the hung ranks' machines (one call per machine, bounded)."""
    check_job_id(job_id)

    async def one(chunk: list[int]) -> None:
        args = [reason]
        for r in chunk:
            args += [client.node_of(r).root, job_id, str(r)]
        res = await client.runner(client.node_of(chunk[0])).arun_script(
            DUMP_SCRIPT, args, timeout=DUMP_TIMEOUT
        )
        if res.returncode != 0:
            raise RuntimeError(res.error_text)

    calls = client._calls(job_id, ranks)
    for chunk, res in zip(calls, await fan_out(one, calls, client.call_limit), strict=True):
        if isinstance(res, BaseException):
            log.warning("Could not dump the stacks of ranks %s: %s", chunk, res)


async def watch_gang(
    client: GangClient,
    job_id: str,
    *,
    hang_timeout: float = 0.0,
    hangs: HangWatch | None = None,
    state: MonitorState | None = None,
    grace: float = 3.0,
    **kwargs: Any,
) -> AsyncGenerator[Poll, None]:
    """:func:`watch.watch` plus hang detection: the loop every watcher of a gang runs.

    ``hangs`` carries the silence timers across calls (the bridge re-enters the watch after a lapse).
    """
    st = state or MonitorState()
    hw = hangs or HangWatch(hang_timeout)
    async with contextlib.aclosing(watch(client, job_id, grace=grace, state=st, **kwargs)) as polls:
        async for poll in polls:
            hung = hw.hung(poll)
            if hung:
                await hw.fire(client, job_id, poll, hung, grace)
                st.cancel_issued = True
            yield poll
