"""When a rank printed each line, read from its node: the ``times`` file the status polls keep.

Every status poll (``runtime.STATUS_SCRIPT``) appends ``size clock`` to a rank's ``times`` when its
log grew, so a watcher that reads the log late (a rank task started after the rank ended, a burst of
output read in one go) still dates each line to within a poll interval of its printing, instead of
the moment it read it. The records are read only when output is read late (a rank task's first poll,
polls dropped while it was busy, the rest of an ended rank): one call then, never one per poll.
"""

from __future__ import annotations

from airflow_provider_sky.model.logtext import LineClock, parse_times
from airflow_provider_sky.node.runtime import check_job_id
from airflow_provider_sky.node.scripts import load
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.watch.jobs import GangClient

#: ``root job rank start end``: the records dating bytes ``start``..``end`` of the rank's log (the
#: first whose size passes ``start`` up to the first that reaches ``end``). Read-only.
TIMES_SCRIPT = load("line_times.sh")


def times_args(root: str, job_id: str, rank: int, start: int, end: int) -> list[str]:
    """Arguments of :data:`TIMES_SCRIPT`, validated (they travel as argv)."""
    if not root or "\n" in root:
        raise ValueError(f"node root {root!r} must be a non-empty path without a newline")
    return [root, check_job_id(job_id), str(int(rank)), str(max(0, int(start))), str(max(0, int(end)))]


async def aread_times(
    client: GangClient, job_id: str, rank: int, start: int, end: int, clock: LineClock
) -> int:
    """Add to ``clock`` the node's records for bytes ``start``..``end`` of a rank's log; how many.

    Best effort: a node that cannot answer (or an older job without records) leaves the lines to be
    dated when they are read.
    """
    if end <= start:
        return 0
    node = client.node_of(rank)
    try:
        res = await client.runner(node).arun_script(
            TIMES_SCRIPT, times_args(node.root, job_id, rank, start, end), timeout=30
        )
    except (RunnerError, ValueError):  # the log itself is read next, with its own error handling
        return 0
    if res.returncode != 0:
        return 0
    records = parse_times(res.stdout.decode("utf-8", "replace"))
    for size, at in records:
        clock.add(size, at)
    return len(records)
