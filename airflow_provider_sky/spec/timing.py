"""The timing and count arguments of every entry point, checked in one place when the DAG is parsed.

The operators, ``sky_gang``, ``@task.sky``, the gang sensor and the triggers all take some of
``poll_interval``, ``grace``, ``lost_after``, ``hang_timeout``, ``orphan_timeout``, ``idle_down``,
``bridge_timeout`` and ``triggerers``. Why here and not where they are used: a zero poll interval
makes the watcher ask every node for its status hundreds of times a second, a negative grace or a
zero ``lost_after`` changes what a failure means, and none of that shows until a gang runs. Each
entry point passes every such argument it takes to :func:`check_timing`, which names the field and
the allowed range. (The whole-gang retry numbers are checked by ``retry.RetryPolicy.build``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from airflow_provider_sky.spec import SpecError

DAY = 86400.0


@dataclass(frozen=True)
class Limit:
    """The allowed values of one argument."""

    low: float
    high: float
    #: a good value, shown when the type is wrong
    example: str
    #: what it is for, shown with the range
    why: str
    #: None (and 0) mean "off"
    off: bool = False
    #: a whole number (a count), not seconds
    whole: bool = False
    #: None means "the default" (not off)
    none_ok: bool = False


LIMITS: dict[str, Limit] = {
    "poll_interval": Limit(0.05, 300.0, "0.5", "seconds between two status polls of every node"),
    "grace": Limit(0.0, 3600.0, "3", "seconds a cancelled rank gets between SIGTERM and SIGKILL"),
    "lost_after": Limit(1.0, DAY, "10", "seconds a node may not answer before its ranks count as lost"),
    "hang_timeout": Limit(1.0, 30 * DAY, "600", "seconds a running rank may stay silent", off=True),
    "orphan_timeout": Limit(
        1.0, 30 * DAY, "300", "seconds the nodes wait for a poll before they kill the job", off=True
    ),
    "idle_down": Limit(1.0, 365 * DAY, "600", "idle seconds before the nodes remove the cluster", off=True),
    "bridge_timeout": Limit(
        1.0, 30 * DAY, "300", "seconds the launch-side watcher waits alone", none_ok=True
    ),
    "triggerers": Limit(1, 1000, "1", "triggerers sharing the watch", whole=True),
}


def _fmt(value: float) -> str:
    """``2592000``, ``0.1``: seconds as a user writes them."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def check_value(name: str, value: Any) -> Any:
    """``value`` of argument ``name`` (a key of :data:`LIMITS`) normalised, or a SpecError naming it."""
    lim = LIMITS[name]
    kind = "a whole number" if lim.whole else "a number of seconds"
    off = " (0 or None: off)" if lim.off else ""
    if value is None and (lim.off or lim.none_ok):
        return None
    if lim.off and value == 0 and not isinstance(value, bool):
        return None
    if lim.whole:
        ok_type = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok_type:
        what = "a whole number" if lim.whole else "seconds as a number"
        raise SpecError(
            name,
            f"expected {what} (e.g. {lim.example}){' or None for off' if lim.off else ''}, got {value!r}",
        )
    if not math.isfinite(value) or not lim.low <= value <= lim.high:
        raise SpecError(
            name,
            f"must be {kind} from {_fmt(lim.low)} to {_fmt(lim.high)}{off}, got {value!r} ({lim.why})",
        )
    return int(value) if lim.whole else float(value)


#: the timeouts that must span two polls, and what a shorter one would do
_TWO_POLLS = {
    "orphan_timeout": "the nodes would kill a job that is being watched",
    "hang_timeout": "silence is only seen once per poll",
}


def check_timing(**given: Any) -> dict[str, Any]:
    """Every argument given (by its name in :data:`LIMITS`) checked and normalised (None: off), and
    the pairs that must agree: a ``lost_after`` below ``poll_interval`` counts a node lost on one
    missed poll, an ``orphan_timeout`` below two polls kills a job that is being watched."""
    unknown = sorted(set(given) - set(LIMITS))
    if unknown:
        raise TypeError(f"check_timing: unknown argument(s) {', '.join(unknown)}")
    out = {name: check_value(name, value) for name, value in given.items()}
    poll = out.get("poll_interval")
    if poll is not None:
        lost = out.get("lost_after")
        if lost is not None and lost < poll:
            raise SpecError(
                "lost_after",
                f"must be at least poll_interval ({_fmt(poll)} s), got {_fmt(lost)}: a node would count "
                "as lost on one missed poll; raise lost_after or lower poll_interval",
            )
        for name, why in _TWO_POLLS.items():
            value = out.get(name)
            if value is not None and value < 2 * poll:
                raise SpecError(
                    name,
                    f"must be at least two polls (2 x poll_interval = {_fmt(2 * poll)} s), got {_fmt(value)}: "
                    f"{why}; raise it, or 0 / None for off",
                )
    return out
