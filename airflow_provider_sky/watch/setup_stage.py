"""The setup stage of a gang: start setup on every node, watch it, stop the rest on the first failure.

A jobs-layer loop (like ``watch.watch``), kept out of the hook, which owns connections and clients only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from airflow_provider_sky.errors import SetupFailed as SetupFailed
from airflow_provider_sky.model.gang import BAD, CANCELLED, GangStatus
from airflow_provider_sky.model.logtext import TAIL_LINES, LineSplitter, tail_text
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.spec import TaskSpec
from airflow_provider_sky.watch.jobs import DEFAULT_ORPHAN_TIMEOUT, GangClient, run_sync
from airflow_provider_sky.watch.loop import MonitorState, watch


def run_setup(
    client: GangClient,
    spec: TaskSpec,
    job_id: str,
    *,
    on_log: Callable[[int, str], None],
    poll_interval: float = 0.5,
    grace: float = 3.0,
    orphan_timeout: float = DEFAULT_ORPHAN_TIMEOUT,
    idle_down: float = 0,
) -> None:
    """Setup on every node at once; the first failure stops the rest and raises :class:`SetupFailed`.

    ``orphan_timeout``: the nodes kill the setup when nothing polled it for that long (0: never).
    ``idle_down``: the nodes tear the cluster down once nothing ran on it for that long (0: never).

    Every node's setup log is read to its end (in bounded chunks) before this returns or raises,
    so no line is lost and a failure quotes the real last lines of the failed nodes' logs.
    """
    if not spec.setup:
        return
    splitters: dict[int, LineSplitter] = {}
    tails: dict[int, deque[str]] = {}

    def show(rank: int, data: bytes | None) -> None:
        """Log ``data``'s complete lines (a line split across reads is joined); None: the log ended."""
        lines = splitters.setdefault(rank, LineSplitter(mask=spec.redacted))
        tail = tails.setdefault(rank, deque(maxlen=TAIL_LINES))
        for line in lines.flush() if data is None else lines.feed(data):
            on_log(rank, line)
            tail.append(line)

    async def go() -> GangStatus:
        await client.alaunch(
            spec, job_id, stage="setup", orphan_timeout=orphan_timeout, idle_down=idle_down, grace=grace
        )
        state = MonitorState()
        last = None
        async for poll in watch(client, job_id, poll_interval=poll_interval, grace=grace, state=state):
            for rank, (_, data) in sorted(poll.chunks.items()):
                show(rank, data)
            last = poll
        assert last is not None
        # a poll reads at most one chunk per node: what the nodes printed since is still unread
        for st in last.status.ranks:
            try:
                async for data in client.aread_range(
                    job_id, st.rank, state.offsets.get(st.rank, 0), st.log_size
                ):
                    show(st.rank, data)
            except RunnerError as exc:
                on_log(st.rank, f"(the rest of this setup log could not be read: {exc})")
            show(st.rank, None)
        return last.status

    status = run_sync(go())
    if status.failed:
        bad = [r for r in status.ranks if r.state in BAD]
        parts = [f"rank {r.rank} ({r.ip}) exit code {r.exit_code}: {r.reason}" for r in bad]
        stopped = [r.rank for r in status.ranks if r.state == CANCELLED]
        msg = "setup failed (FAILED_SETUP). Failed workers: " + "; ".join(parts)
        if stopped:
            msg += f". Setup stopped on ranks {stopped}"
        for r in bad:
            msg += f"\n--- last lines of rank {r.rank}'s setup log ---\n"
            msg += tail_text(tails.get(r.rank, ()))
        raise SetupFailed(msg)
