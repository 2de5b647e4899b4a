"""How a gang is watched, as one frozen object: the connection, the poll interval, the cancel grace, the
lost-node and hang timeouts and the whole-gang retry policy.

Why one object: the job task (its bridge), the rank tasks, the gang sensor and their triggers must all
watch one job with the same settings (the triggers share one poll per job and settings), and each took
them as the same arguments, checked and passed on in its own copy. They are checked once
(:meth:`WatchSettings.build`) and written as trigger and bridge keyword arguments once
(:meth:`WatchSettings.to_kwargs`), in the flat form triggers have always been serialized in, so a
trigger serialized by an older release loads (:meth:`WatchSettings.from_kwargs`). No Airflow import.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.spec.timing import check_timing
from airflow_provider_sky.watch.hang import check_hang_timeout
from airflow_provider_sky.watch.retry import RetryPolicy, operator_args

#: the connection a watch uses when none is given (``SkyHook.default_conn_name``)
DEFAULT_CONN_ID = "sky_default"

#: the trigger and bridge keyword arguments :meth:`WatchSettings.to_kwargs` writes
KWARGS = ("sky_conn_id", "poll_interval", "grace", "lost_after", "hang_timeout", "retry")


@dataclass(frozen=True)
class WatchSettings:
    """How every watcher of one gang polls it, decides it failed and retries it."""

    sky_conn_id: str | None = DEFAULT_CONN_ID
    #: seconds between two status polls of every node
    poll_interval: float = 0.5
    #: seconds a cancelled rank gets between SIGTERM and SIGKILL
    grace: float = 3.0
    #: seconds a node may not answer before its ranks count as lost
    lost_after: float = 10.0
    #: seconds a running rank may stay silent before it counts as hung (0: off)
    hang_timeout: float = 0.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    @classmethod
    def build(
        cls,
        sky_conn_id: str | None,
        poll_interval: Any,
        grace: Any,
        lost_after: Any,
        hang_timeout: Any = None,
        policy: RetryPolicy | None = None,
        **timing: Any,
    ) -> WatchSettings:
        """The settings from user arguments, or a SpecError naming the field. ``timing``: the caller's
        other timing arguments (``orphan_timeout``, ...), checked in the same call (see :mod:`timing`)."""
        check_timing(
            poll_interval=poll_interval,
            grace=grace,
            lost_after=lost_after,
            **timing,
            hang_timeout=hang_timeout,
        )
        return cls(
            sky_conn_id,
            poll_interval,
            grace,
            lost_after,
            check_hang_timeout(hang_timeout),
            policy or RetryPolicy(),
        )

    @property
    def retry_kwarg(self) -> dict[str, Any] | None:
        """The retry policy as a keyword argument (``RetryPolicy.to_dict``); None: no retries."""
        return self.retry.to_dict() if self.retry.retries else None

    def operator_kwargs(self) -> dict[str, Any]:
        """The settings as the watching operators' keyword arguments (the job task, the rank tasks and the
        gang sensor: ``sky_gang`` hands each the same)."""
        out: dict[str, Any] = {
            "lost_after": self.lost_after,
            "hang_timeout": self.hang_timeout or None,
            "sky_conn_id": self.sky_conn_id,
            "poll_interval": self.poll_interval,
            "grace": self.grace,
        }
        if self.retry.retries:
            out.update(operator_args(self.retry))
        return out

    def to_kwargs(self) -> dict[str, Any]:
        """The settings as trigger and bridge keyword arguments (JSON values; :data:`KWARGS`)."""
        return {
            "sky_conn_id": self.sky_conn_id,
            "poll_interval": self.poll_interval,
            "grace": self.grace,
            "lost_after": self.lost_after,
            "hang_timeout": self.hang_timeout,
            "retry": self.retry_kwarg,
        }

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> WatchSettings:
        """Back from :meth:`to_kwargs` (or a trigger's kwargs of any release: a missing key is its
        default), checked as :meth:`build` checks them."""
        d = cls()
        values = {k: kwargs.get(k, getattr(d, k)) for k in ("poll_interval", "grace", "lost_after")}
        hang = kwargs.get("hang_timeout", 0.0)
        check_timing(**values, hang_timeout=hang)
        return cls(
            kwargs.get("sky_conn_id", d.sky_conn_id),
            float(values["poll_interval"]),
            float(values["grace"]),
            float(values["lost_after"]),
            float(hang or 0),
            RetryPolicy.from_dict(kwargs.get("retry")),
        )


class WatchFields:
    """The watch settings held in ``self.watch`` as the attributes their arguments are named by (the
    watcher tasks and their triggers)."""

    watch: WatchSettings

    @property
    def sky_conn_id(self) -> str | None:
        return self.watch.sky_conn_id

    @property
    def poll_interval(self) -> float:
        return self.watch.poll_interval

    @property
    def grace(self) -> float:
        return self.watch.grace

    @property
    def lost_after(self) -> float:
        return self.watch.lost_after

    @property
    def hang_timeout(self) -> float:
        return self.watch.hang_timeout

    @property
    def retry(self) -> dict[str, Any] | None:
        """The whole-gang retry policy as trigger kwargs (None: no retries)."""
        return self.watch.retry_kwarg
