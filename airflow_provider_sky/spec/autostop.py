"""SkyPilot's ``resources.autostop``: how long a kept cluster may sit idle before it goes away.

SkyPilot's forms (``sky/resources.py`` ``AutostopConfig.from_yaml_config``, the schema in
``sky/utils/schemas.py``): ``true`` (the default idle time, 5 minutes), ``false`` (off), a whole number of
minutes (``10``), a whole number with a unit (``"10m"``, ``"1h"``, ``"2d"``, ``"1w"``), or a mapping
``{idle_minutes: 10, down: true, wait_for: jobs}``. SkyPilot stops the cluster and keeps its disks, or with
``down: true`` tears it down. No backend here can stop a cluster and keep its disks, so both become the
provider's idle-down: the nodes tear the cluster down once nothing ran on it for that long (a warning at
launch says so when the YAML asked for a stop). Idle here means no setup and no rank running on the
cluster; SSH sessions are not watched.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from airflow_provider_sky.spec.common import SpecError, _type_name

FIELD = "resources.autostop"
#: SkyPilot's idle minutes for ``autostop: true`` and a mapping without ``idle_minutes`` (``sky autostop``'s
#: default, as its docs say)
DEFAULT_IDLE_MINUTES = 5
#: SkyPilot's time units for the string form, in minutes (``sky/skylet/constants.py`` ``TIME_UNITS``)
TIME_UNITS: dict[str, int] = {"m": 1, "h": 60, "d": 24 * 60, "w": 7 * 24 * 60}
#: SkyPilot's ``wait_for`` values (``AutostopWaitFor``), its default first
WAIT_FOR = ("jobs_and_ssh", "jobs", "none")
KEYS = ("idle_minutes", "down", "wait_for")
#: the longest idle time: ``idle_down``'s limit (365 days)
MAX_MINUTES = 365 * 24 * 60
#: SkyPilot's ``0`` (as soon as idle) is this many minutes here: a gang's setup and run are two launches,
#: and the cluster must outlive the pause between them
MIN_MINUTES = 1
_TIME = re.compile(r"(\d+)([A-Za-z]*)")
_FIX = (
    "write true (5 idle minutes), false, whole minutes (10), minutes with a unit m, h, d or w ('10m', '1h'), "
    "or a mapping such as {idle_minutes: 10, down: true}"
)


@dataclass(frozen=True)
class Autostop:
    """A parsed ``resources.autostop`` (None when off)."""

    idle_minutes: int = DEFAULT_IDLE_MINUTES
    #: SkyPilot's autodown (True) or its stop (False; here a teardown too, with a warning)
    down: bool = False
    wait_for: str = WAIT_FOR[0]

    @property
    def idle_seconds(self) -> int:
        """The provider's ``idle_down`` this means."""
        return max(self.idle_minutes, MIN_MINUTES) * 60

    def to_yaml(self) -> dict[str, Any]:
        out: dict[str, Any] = {"idle_minutes": self.idle_minutes, "down": self.down}
        if self.wait_for != WAIT_FOR[0]:
            out["wait_for"] = self.wait_for
        return out

    def launch_note(self) -> tuple[bool, str]:
        """(is it a warning, what to log) when the nodes are armed with it at launch: one line, saying
        what SkyPilot would have done that this provider does otherwise."""
        minutes = max(self.idle_minutes, MIN_MINUTES)
        when = f"{minutes} idle minute{'s' if minutes != 1 else ''}"
        if self.idle_minutes < MIN_MINUTES:
            when += f" (0 counts as {MIN_MINUTES}: the cluster must outlive the pause between setup and run)"
        parts = []
        if self.down:
            parts.append(f"{FIELD}: the cluster is torn down after {when} (SkyPilot's autodown)")
        else:
            parts.append(
                f"{FIELD}: SkyPilot would stop the cluster after {when} and keep its disks; no backend here "
                "can stop a cluster, so it is torn down instead (as SkyPilot does on clouds that cannot "
                "stop one): its disks and anything written on the nodes go with it"
            )
        parts.append("idle means no setup and no rank running on it (SSH sessions do not count)")
        if self.wait_for == "none":
            parts.append(
                "wait_for: none is not honoured: a running setup or rank always keeps the cluster up"
            )
        return (not self.down or self.wait_for == "none"), "; ".join(parts)


def _minutes(value: int, where: str, shown: object) -> int:
    if value < 0:
        raise SpecError(
            where,
            f"must be 0 or more idle minutes, got {shown!r} (SkyPilot's -1 cancels an autostop: leave "
            f"autostop out, or write false); {_FIX}",
        )
    if value > MAX_MINUTES:
        raise SpecError(where, f"at most {MAX_MINUTES} minutes (365 days), got {shown!r}; {_FIX}")
    return value


def _parse_time(text: str, where: str) -> int:
    """``"10"``, ``"10m"``, ``"1h"``, ``"2d"``, ``"1w"``: whole minutes (SkyPilot's ``TIME_PATTERN``)."""
    stripped = text.strip()
    m = _TIME.fullmatch(stripped)
    if stripped.startswith("-") and _TIME.fullmatch(stripped[1:]):
        return _minutes(-1, where, text)
    if not m:
        raise SpecError(where, f"{text!r} is not a whole number with an optional unit; {_FIX}")
    number, unit = int(m.group(1)), m.group(2).lower()
    if unit and unit not in TIME_UNITS:
        raise SpecError(
            where,
            f"{text!r} has the unit {m.group(2)!r}; SkyPilot's units are m (minutes), h (hours), d (days) "
            f"and w (weeks), e.g. '30m' or '2h'",
        )
    return _minutes(number * TIME_UNITS.get(unit, 1), where, text)


def parse_autostop(value: object) -> Autostop | None:
    """``resources.autostop`` in any of SkyPilot's forms; None: off (``false``, or not given)."""
    where = FIELD
    if value is None or value is False:
        return None
    if value is True:
        return Autostop()
    if isinstance(value, int):
        return Autostop(idle_minutes=_minutes(value, where, value))
    if isinstance(value, str):
        return Autostop(idle_minutes=_parse_time(value, where))
    if not isinstance(value, Mapping):
        raise SpecError(where, f"got {_type_name(value)} {value!r}; {_FIX}")
    for key in value:
        if key in ("hook", "hook_timeout"):
            raise SpecError(
                f"{where}.{key}",
                "is SkyPilot's command run before an idle cluster stops, which no backend here runs; "
                "remove it, and save what must outlive the cluster at the end of run (or to a bucket "
                "mounted in file_mounts)",
            )
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), KEYS, n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'?" if close else "its keys are " + ", ".join(KEYS)
            raise SpecError(f"{where}.{key}", f"unknown key of autostop; {hint}")
    minutes = value.get("idle_minutes")
    if minutes is None:
        minutes = DEFAULT_IDLE_MINUTES
    elif isinstance(minutes, bool) or not isinstance(minutes, int):
        raise SpecError(
            f"{where}.idle_minutes",
            f"must be a whole number of minutes (e.g. idle_minutes: 10), got {_type_name(minutes)} {minutes!r}",
        )
    minutes = _minutes(minutes, f"{where}.idle_minutes", minutes)
    down = value.get("down")
    if down is None:
        down = False
    if not isinstance(down, bool):
        raise SpecError(f"{where}.down", f"must be true or false, got {_type_name(down)} {down!r}")
    wait_for = value.get("wait_for")
    if wait_for is None:
        wait_for = WAIT_FOR[0]
    if not isinstance(wait_for, str) or wait_for.strip().lower() not in WAIT_FOR:
        raise SpecError(f"{where}.wait_for", f"must be one of {', '.join(WAIT_FOR)}, got {wait_for!r}")
    return Autostop(idle_minutes=minutes, down=down, wait_for=wait_for.strip().lower())
