"""The watch settings the rank tasks and the gang sensor share, passed on to their triggers as is."""

from __future__ import annotations

from typing import Any


class GangWatchMixin:
    """Holds how a task watches a job (connection, poll interval, cancel grace, lost-node timeout).

    Every watcher of one job must use the same settings: the triggers share one poll per job and
    interval, so one rank task polling at another rate would start a second poll of every node.
    """

    cluster: Any
    sky_conn_id: str | None
    poll_interval: float
    grace: float
    lost_after: float

    def _init_watch(
        self, cluster: Any, sky_conn_id: str | None, poll_interval: float, grace: float, lost_after: float
    ) -> None:
        self.cluster = cluster
        self.sky_conn_id = sky_conn_id
        self.poll_interval = poll_interval
        self.grace = grace
        self.lost_after = lost_after

    def _watch_kwargs(self, job_id: Any) -> dict[str, Any]:
        """The trigger keyword arguments common to SkyRankTrigger and SkyGangTrigger."""
        return {
            "cluster": self.cluster,
            "job_id": str(job_id),
            "sky_conn_id": self.sky_conn_id,
            "poll_interval": self.poll_interval,
            "grace": self.grace,
            "lost_after": self.lost_after,
        }
