"""The task spec: a SkyPilot-style task YAML (or the same fields as Python arguments), validated up front.

Everything a gang job needs is checked here, before any node is touched, so a typo or an impossible request
fails at parse time with a message naming the field and the fix, instead of half a gang starting. This module
imports neither Airflow nor any backend: operators, triggers and backends all build on it.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

import yaml

__all__ = [
    "RANK_VARIABLES",
    "Accelerator",
    "BackendCapabilities",
    "Resources",
    "SpecError",
    "TaskSpec",
    "check_backend",
    "describe_resources",
    "is_bucket_source",
    "load_task_yaml",
    "parse_task",
    "problems_error",
    "resource_problems",
    "task_from_args",
]


class SpecError(ValueError):
    """Bad task spec. ``str()`` is ``'<field>: <message>'``; the message says what is wrong and how to fix it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type[SpecError], tuple[str, str]]:
        # The default reduce would call SpecError(str(self)) and fail: keep it picklable across processes.
        return (SpecError, (self.field, self.message))


#: Set by the provider per rank; a user value would silently break rank discovery, so it is an error.
RANK_VARIABLES: frozenset[str] = frozenset(
    {
        "SKYPILOT_NODE_RANK",
        "SKYPILOT_NODE_IPS",
        "SKYPILOT_NUM_NODES",
        "SKYPILOT_NUM_GPUS_PER_NODE",
        "SKYPILOT_SETUP_NUM_GPUS_PER_NODE",
        "SKYPILOT_SETUP_NODE_RANK",
        "SKYPILOT_SETUP_NODE_IPS",
        "SKYPILOT_TASK_ID",
        "SKYPILOT_CLUSTER_INFO",
        "MASTER_ADDR",
        "WORLD_SIZE",
        "NNODES",
        "NODE_RANK",
        "RANK",
        "SKY_PROGRESS_FILE",
        "SKY_ATTEMPT",
    }
)

TOP_LEVEL_KEYS: tuple[str, ...] = (
    "name",
    "num_nodes",
    "resources",
    "setup",
    "run",
    "envs",
    "secrets",
    "workdir",
    "file_mounts",
)
RESOURCE_KEYS: tuple[str, ...] = (
    "infra",
    "cloud",
    "region",
    "zone",
    "cpus",
    "memory",
    "accelerators",
    "instance_type",
    "use_spot",
    "image_id",
    "disk_size",
    "labels",
    "any_of",
    "ordered",
)
#: the keys that list alternatives (each entry a resources mapping; the first the backend can satisfy wins)
ALTERNATIVE_KEYS: tuple[str, ...] = ("any_of", "ordered")
_ENTRY_KEYS: tuple[str, ...] = tuple(k for k in RESOURCE_KEYS if k not in ALTERNATIVE_KEYS)
# SkyPilot keys users may copy from existing YAML; named so the error says "unsupported", not "typo".
_SKYPILOT_ONLY_TOP = frozenset({"service", "config", "volumes", "pool", "event_callback", "experimental"})
_SKYPILOT_ONLY_RESOURCES = frozenset(
    {
        "ports",
        "job_recovery",
        "autostop",
        "accelerator_args",
        "disk_tier",
        "network_tier",
        "priority",
    }
)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TASK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_CLOUD_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_ACCEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_NUMBER = r"(\d+(?:\.\d+)?|\.\d+)"
_CPUS = re.compile(rf"^{_NUMBER}(?P<plus>\+?)$")
_MEMORY = re.compile(rf"^{_NUMBER}\s*(?:(?P<unit>[KMGTP])(?:IB|I|B)?)?(?P<plus>\+?)$", re.IGNORECASE)
_MEMORY_UNIT_GIB = {"K": 2.0**-20, "M": 2.0**-10, "G": 1.0, "T": 2.0**10, "P": 2.0**20}
_CLOUD_ALIASES = {"k8s": "kubernetes"}
# For these the part after the first '/' is one name (a kube context may itself contain '/').
_CONTEXT_CLOUDS = frozenset({"kubernetes", "ssh"})


def _fmt_number(value: float) -> str:
    """``8.0`` -> ``"8"``, ``0.5`` -> ``"0.5"``: show numbers the way a user writes them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _unknown_key(prefix: str, key: str, valid: tuple[str, ...], unsupported: frozenset[str]) -> SpecError:
    where = f"{prefix}.{key}" if prefix else key
    scope = f"{prefix}:" if prefix else "the task"
    if key in unsupported:
        return SpecError(where, f"is a SkyPilot key this provider does not support; remove it from {scope}")
    if not prefix and key in RESOURCE_KEYS:
        return SpecError(where, f"belongs under resources:, e.g. 'resources: {{{key}: ...}}'")
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'?" if close else "valid keys are: " + ", ".join(valid)
    return SpecError(where, f"unknown key in {scope}; {hint}")


def _check_keys(
    prefix: str, obj: Mapping[Any, Any], valid: tuple[str, ...], unsupported: frozenset[str]
) -> None:
    for key in obj:
        if not isinstance(key, str):
            where = prefix or "task"
            raise SpecError(where, f"keys must be strings, got {key!r} ({_type_name(key)})")
        if key not in valid:
            raise _unknown_key(prefix, key, valid, unsupported)


def _opt_str(value: object, where: str, what: str) -> str | None:
    """An optional non-empty string (YAML ``key:`` with nothing after it means not given)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise SpecError(where, f"must be a non-empty string ({what}), got {value!r}")
    return value.strip()


# ---------------------------------------------------------------------------------------------------------
# accelerators


@dataclass(frozen=True)
class Accelerator:
    """An accelerator request as the user wrote it; fractions are kept so status can show ``V100:0.5``."""

    name: str
    count: float = 1.0

    def __post_init__(self) -> None:
        # Validated here too, so a directly built Accelerator cannot carry a zero or negative count.
        if not isinstance(self.name, str) or not _ACCEL_NAME.match(self.name):
            raise SpecError("resources.accelerators", f"bad accelerator name {self.name!r}; {_ACCEL_FORMAT}")
        count = self.count
        if isinstance(count, bool) or not isinstance(count, (int, float)):
            raise SpecError(
                "resources.accelerators", f"count must be a number, got {count!r}; {_ACCEL_FORMAT}"
            )
        if not math.isfinite(count) or count <= 0:
            raise SpecError(
                "resources.accelerators", f"count must be greater than 0, got {count!r}; {_ACCEL_FORMAT}"
            )
        object.__setattr__(self, "count", float(count))

    @property
    def gpus_per_node(self) -> int:
        """Whole devices to reserve: schedulers hand out whole GPUs, so a fraction rounds up."""
        return math.ceil(self.count)

    def __str__(self) -> str:
        return f"{self.name}:{_fmt_number(self.count)}"


_ACCEL_FORMAT = (
    "write NAME[:COUNT], e.g. 'V100:1', 'H100:8' or 'V100:0.5', the mapping form {V100: 0.5}, "
    "or alternatives as {A100: 8, H100: 8} or [A100:8, H100:8]"
)


def _parse_count(raw: object, original: object) -> float:
    where = "resources.accelerators"
    if isinstance(raw, bool):
        raise SpecError(where, f"count must be a number, got {original!r}; {_ACCEL_FORMAT}")
    if isinstance(raw, (int, float)):
        count = float(raw)
    elif isinstance(raw, str) and re.fullmatch(_NUMBER, raw.strip()):
        count = float(raw.strip())
    else:
        raise SpecError(where, f"count must be a number, got {original!r}; {_ACCEL_FORMAT}")
    if not math.isfinite(count) or count <= 0:
        raise SpecError(where, f"count must be greater than 0, got {original!r}; {_ACCEL_FORMAT}")
    return count


def _parse_one_accelerator(value: object, original: object) -> Accelerator:
    """``V100``, ``V100:0.5`` or ``{V100: 0.5}``: one accelerator."""
    where = "resources.accelerators"
    if isinstance(value, Accelerator):
        return value
    if isinstance(value, str):
        parts = [p.strip() for p in value.strip().split(":")]
        if len(parts) > 2 or not parts[0]:
            raise SpecError(where, f"malformed accelerator {value!r}; {_ACCEL_FORMAT}")
        if len(parts) == 2 and not parts[1]:
            raise SpecError(where, f"missing count after ':' in {value!r}; {_ACCEL_FORMAT}")
        name = parts[0]
        count = _parse_count(parts[1], original) if len(parts) == 2 else 1.0
    elif isinstance(value, Mapping) and len(value) == 1:
        ((key, raw),) = value.items()
        if not isinstance(key, str):
            raise SpecError(where, f"accelerator name must be a string, got {key!r}; {_ACCEL_FORMAT}")
        if raw is None and ":" in key:
            # YAML reads the flow set {H100:8, H200:8} as keys 'H100:8' and 'H200:8' without values
            return _parse_one_accelerator(key, original)
        name = key.strip()
        count = 1.0 if raw is None else _parse_count(raw, original)
    else:
        raise SpecError(where, f"expected a string, got {_type_name(value)} {value!r}; {_ACCEL_FORMAT}")
    if not _ACCEL_NAME.match(name):
        raise SpecError(where, f"bad accelerator name {name!r} in {original!r}; {_ACCEL_FORMAT}")
    return Accelerator(name, count)


def _parse_accelerator_options(value: object) -> list[Accelerator | None]:
    """The accelerators a resources mapping allows, in the order written.

    One (``H100:8``, ``{H100: 8}``), or SkyPilot's alternatives: a mapping of several (``{A100: 8, H100: 8}``,
    SkyPilot's "any of") or a list (``[A100:8, H100:8]``, SkyPilot's "in this order"). The first one the
    backend can satisfy is used, in both forms.
    """
    where = "resources.accelerators"
    if value is None:
        return [None]
    if isinstance(value, Mapping) and len(value) > 1:
        return [_parse_one_accelerator({k: v}, value) for k, v in value.items()]
    if isinstance(value, Mapping) and not value:
        raise SpecError(where, f"the mapping form needs at least one accelerator; {_ACCEL_FORMAT}")
    if isinstance(value, (list, tuple)):
        if not value:
            raise SpecError(where, f"an empty list of alternatives; {_ACCEL_FORMAT}")
        out: list[Accelerator | None] = []
        for item in value:
            if isinstance(item, Mapping) and len(item) != 1:
                raise SpecError(
                    where, f"each alternative in the list is one accelerator, got {item!r}; {_ACCEL_FORMAT}"
                )
            out.append(_parse_one_accelerator(item, value))
        return out
    if isinstance(value, (set, frozenset)):
        raise SpecError(
            where, f"write alternatives as a list or a mapping, got a set {value!r}; {_ACCEL_FORMAT}"
        )
    return [_parse_one_accelerator(value, value)]


# ---------------------------------------------------------------------------------------------------------
# resources


@dataclass(frozen=True)
class Resources:
    """What each node needs. Only what the user set is checked against a backend (see :meth:`requested`)."""

    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    cpus: str | None = None
    memory: str | None = None
    accelerators: Accelerator | None = None
    instance_type: str | None = None
    use_spot: bool = False
    image_id: str | None = None
    disk_size: int | None = None
    labels: dict[str, str] = field(default_factory=dict)

    def requested(self) -> dict[str, object]:
        """The fields the user set (non-default), so a backend can refuse what it cannot honour."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value is False or (f.name == "labels" and not value):
                continue
            out[f.name] = dict(value) if f.name == "labels" else value
        return out


def _parse_quantity(value: object, where: str, pattern: re.Pattern[str], what: str) -> str | None:
    """``4``, ``0.5``, ``"4"``, ``"4+"`` ('at least'); memory may carry a unit and is returned in GiB."""
    if value is None:
        return None
    fix = f"must be a positive number of {what}, optionally with '+' meaning 'at least' (e.g. 4 or 4+)"
    if what == "GiB":
        fix += ", or with a unit such as 512MB, 16GB, 1TB"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SpecError(where, f"{fix}; got {_type_name(value)} {value!r}")
    plus = ""
    if isinstance(value, str):
        m = pattern.match(value.strip())
        if not m:
            raise SpecError(where, f"{fix}; got {value!r}")
        number = float(m.group(1))
        unit = m.groupdict().get("unit")
        if unit:
            number *= _MEMORY_UNIT_GIB[unit.upper()]
        plus = m.group("plus")
    else:
        number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise SpecError(where, f"must be greater than 0; {fix}; got {value!r}")
    return _fmt_number(number) + plus


def _normalise_cloud(value: str, where: str) -> str:
    cloud = value.strip().lower()
    cloud = _CLOUD_ALIASES.get(cloud, cloud)
    if not _CLOUD_NAME.match(cloud):
        raise SpecError(
            where, f"bad cloud name {value!r}; use a name such as aws, gcp, kubernetes (or k8s), local"
        )
    return cloud


def _parse_infra(value: object) -> tuple[str | None, str | None, str | None]:
    """``aws/us-east-1/us-east-1a`` -> (cloud, region, zone); ``*`` means 'any' for that part."""
    where = "resources.infra"
    fix = "write CLOUD[/REGION[/ZONE]], e.g. 'aws/us-east-1', 'k8s' or 'kubernetes/my-context'"
    if not isinstance(value, str) or not value.strip():
        raise SpecError(where, f"must be a non-empty string; {fix}; got {value!r}")
    text = value.strip()
    head, _, rest = (p.strip() for p in text.partition("/"))
    if not head:
        raise SpecError(where, f"missing cloud in {value!r}; {fix}")
    cloud = None if head == "*" else _normalise_cloud(head, where)
    if cloud in _CONTEXT_CLOUDS:
        parts: list[str] = [rest] if rest else []
    else:
        parts = [p.strip() for p in rest.split("/")] if rest else []
    if len(parts) > 2:
        raise SpecError(where, f"too many parts in {value!r}; {fix}")
    if any(not p for p in parts):
        raise SpecError(where, f"empty part in {value!r}; {fix}")
    region = parts[0] if parts and parts[0] != "*" else None
    zone = parts[1] if len(parts) > 1 and parts[1] != "*" else None
    return cloud, region, zone


def _infra_string(cloud: str | None, region: str | None, zone: str | None) -> str | None:
    if cloud is None and region is None and zone is None:
        return None
    parts = [cloud or "*", region or "*", zone or "*"]
    while parts[-1] == "*" and len(parts) > 1:
        parts.pop()
    return "/".join(parts)


def _parse_labels(value: object) -> dict[str, str]:
    where = "resources.labels"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            where, f"must be a mapping of label names to values, got {_type_name(value)} {value!r}"
        )
    out: dict[str, str] = {}
    for key, raw in value.items():
        if not isinstance(key, str) or not key.strip():
            raise SpecError(where, f"label names must be non-empty strings, got {key!r}")
        out[key] = _coerce_value(raw, f"{where}.{key}", "give the label a value, e.g. team: ml")
    return out


def _resources_as_mapping(value: Resources) -> dict[str, object]:
    """A directly built Resources goes through the same parser, so it is validated and normalised too."""
    out: dict[str, object] = {f.name: getattr(value, f.name) for f in fields(value)}
    return out


_DISK = re.compile(r"^(\d+)\s*(?:(?P<unit>[GT])(?:IB|I|B)?)?$", re.IGNORECASE)


def _parse_disk_size(value: object) -> int | None:
    """GB as a whole number: ``256``, or with SkyPilot's units, ``1024GB`` / ``1TB``."""
    if value is None:
        return None
    fix = (
        f"must be a positive whole number of GB, e.g. 256, or with a unit, e.g. 1024GB or 1TB; got {value!r}"
    )
    if isinstance(value, bool):
        raise SpecError("resources.disk_size", fix)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (m := _DISK.match(value.strip())):
        size = int(m.group(1)) * (1024 if (m.group("unit") or "G").upper() == "T" else 1)
    else:
        raise SpecError("resources.disk_size", fix)
    if size <= 0:
        raise SpecError("resources.disk_size", fix)
    return size


def _build_resources(value: Mapping[str, object], accelerators: Accelerator | None) -> Resources:
    """One alternative: a resources mapping whose keys were checked, with its accelerator chosen."""
    cloud = _opt_str(value.get("cloud"), "resources.cloud", "a cloud name such as aws or kubernetes")
    cloud = _normalise_cloud(cloud, "resources.cloud") if cloud is not None else None
    region = _opt_str(value.get("region"), "resources.region", "a region name")
    zone = _opt_str(value.get("zone"), "resources.zone", "a zone name")
    if value.get("infra") is not None:
        infra = value["infra"]
        i_cloud, i_region, i_zone = _parse_infra(infra)
        for name, given, implied in (
            ("cloud", cloud, i_cloud),
            ("region", region, i_region),
            ("zone", zone, i_zone),
        ):
            if given is not None and implied is not None and given != implied:
                raise SpecError(
                    f"resources.{name}",
                    f"{given!r} disagrees with infra {infra!r} (which means {name} {implied!r}); "
                    f"give only infra, or make them match",
                )
        cloud, region, zone = cloud or i_cloud, region or i_region, zone or i_zone

    use_spot = value.get("use_spot")
    if use_spot is None:
        use_spot = False
    if not isinstance(use_spot, bool):
        raise SpecError("resources.use_spot", f"must be true or false, got {use_spot!r}")

    disk_size = _parse_disk_size(value.get("disk_size"))

    return Resources(
        cloud=cloud,
        region=region,
        zone=zone,
        cpus=_parse_quantity(value.get("cpus"), "resources.cpus", _CPUS, "CPUs"),
        memory=_parse_quantity(value.get("memory"), "resources.memory", _MEMORY, "GiB"),
        accelerators=accelerators,
        instance_type=_opt_str(
            value.get("instance_type"), "resources.instance_type", "an instance type name"
        ),
        use_spot=use_spot,
        image_id=_opt_str(value.get("image_id"), "resources.image_id", "one image id or docker:IMAGE"),
        disk_size=disk_size,
        labels=_parse_labels(value.get("labels")),
    )


_RESOURCES_FIX = "must be a mapping such as {cpus: 4+, accelerators: V100:1}"
_ALT_FIX = "e.g. any_of: [{accelerators: A100:8}, {accelerators: H100:8}]"
_INFRA_PARTS = ("cloud", "region", "zone")


def _overlay(base: Mapping[str, object], entry: Mapping[str, object]) -> dict[str, object]:
    """``entry``'s keys over ``base``'s; ``infra`` and ``cloud``/``region``/``zone`` say the same thing, so
    one side's ``infra`` replaces the other side's parts (and the parts replace an ``infra``)."""
    merged = dict(base)
    if entry.get("infra") is not None:
        for key in _INFRA_PARTS:
            merged.pop(key, None)
    if any(entry.get(k) is not None for k in _INFRA_PARTS) and merged.get("infra") is not None:
        infra = merged.pop("infra")
        try:
            parts = _parse_infra(infra)
        except SpecError:
            merged["infra"] = infra  # keep it, so its own error is reported
        else:
            for key, part in zip(_INFRA_PARTS, parts, strict=True):
                if part is not None:
                    merged.setdefault(key, part)
    for key, value in entry.items():
        merged[key] = value
    return merged


def _renamed(err: SpecError, prefix: str) -> SpecError:
    """An error of one alternative names it: ``resources.any_of[1].accelerators``."""
    field_name = err.field
    if field_name == "resources" or field_name.startswith("resources."):
        field_name = prefix + field_name[len("resources") :]
    return SpecError(field_name, err.message)


def _parse_resource_options(value: object) -> tuple[Resources, ...]:
    """Every alternative a task's ``resources`` allows, in the order written (at least one).

    ``any_of`` / ``ordered`` list alternatives (each entry overrides the keys around it), and so do several
    ``accelerators`` (a mapping or a list). Duplicates collapse; the first the backend can satisfy is used.
    """
    where = "resources"
    if value is None:
        return (Resources(),)
    if isinstance(value, Resources):
        value = _resources_as_mapping(value)
    if not isinstance(value, Mapping):
        raise SpecError(where, f"{_RESOURCES_FIX}, got {value!r}")
    _check_keys(where, value, RESOURCE_KEYS, _SKYPILOT_ONLY_RESOURCES)
    given = [k for k in ALTERNATIVE_KEYS if value.get(k) is not None]
    if len(given) > 1:
        raise SpecError(
            "resources.ordered",
            "give any_of or ordered, not both (both list alternatives, tried in order here)",
        )
    base = {k: v for k, v in value.items() if k not in ALTERNATIVE_KEYS}
    entries: list[tuple[str, dict[str, object]]] = [("resources", base)]
    if given:
        key = given[0]
        raw = value[key]
        if not isinstance(raw, (list, tuple)) or not raw:
            raise SpecError(f"resources.{key}", f"must be a non-empty list of resources mappings, {_ALT_FIX}")
        entries = []
        for i, entry in enumerate(raw):
            prefix = f"resources.{key}[{i}]"
            if not isinstance(entry, Mapping):
                raise SpecError(prefix, f"{_RESOURCES_FIX}, got {_type_name(entry)} {entry!r}; {_ALT_FIX}")
            for nested in ALTERNATIVE_KEYS:
                if nested in entry:
                    raise SpecError(
                        f"{prefix}.{nested}", "alternatives cannot be nested; list them all in one place"
                    )
            _check_keys(prefix, entry, _ENTRY_KEYS, _SKYPILOT_ONLY_RESOURCES)
            entries.append((prefix, _overlay(base, entry)))
    out: list[Resources] = []
    for prefix, entry in entries:
        try:
            for acc in _parse_accelerator_options(entry.get("accelerators")):
                res = _build_resources(entry, acc)
                if res not in out:
                    out.append(res)
        except SpecError as err:
            raise _renamed(err, prefix) from None
    return tuple(out)


def _parse_resources(value: object) -> Resources:
    """Exactly one alternative: a ``Resources`` built directly, a backend's choice, one pod's resources."""
    options = _parse_resource_options(value)
    if len(options) != 1:
        raise SpecError("resources", f"expected one set of resources, got {len(options)} alternatives")
    return options[0]


def _resources_to_dict(res: Resources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    infra = _infra_string(res.cloud, res.region, res.zone)
    if infra is not None and _parse_infra(infra) == (res.cloud, res.region, res.zone):
        out["infra"] = infra
    else:  # e.g. a kubernetes context plus a zone: infra cannot say that unambiguously
        for key in ("cloud", "region", "zone"):
            if getattr(res, key) is not None:
                out[key] = getattr(res, key)
    for key in ("cpus", "memory", "instance_type", "image_id", "disk_size"):
        if getattr(res, key) is not None:
            out[key] = getattr(res, key)
    if res.accelerators is not None:
        out["accelerators"] = str(res.accelerators)
    if res.use_spot:
        out["use_spot"] = True
    if res.labels:
        out["labels"] = dict(res.labels)
    return out


# ---------------------------------------------------------------------------------------------------------
# envs, secrets, file mounts


def _coerce_value(raw: object, where: str, fix_none: str) -> str:
    """YAML turns ``PORT: 29500`` into an int and ``DEBUG: true`` into a bool; the shell needs strings."""
    if raw is None:
        raise SpecError(where, f"a value must be given (null is not allowed); {fix_none}")
    if isinstance(raw, bool):
        text = "true" if raw else "false"
    elif isinstance(raw, (int, float, str)):
        text = str(raw)
    else:
        raise SpecError(
            where, f"must be a string or number, got {_type_name(raw)} {raw!r}; quote it as a string"
        )
    if "\0" in text:
        raise SpecError(where, "contains a NUL byte, which no environment variable can hold; remove it")
    return text


def _parse_env_mapping(value: object, section: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(section, f"must be a mapping of NAME: value, got {_type_name(value)} {value!r}")
    out: dict[str, str] = {}
    for key, raw in value.items():
        where = f"{section}.{key}"
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise SpecError(
                where,
                "is not a valid environment variable name; use letters, digits and '_', "
                "not starting with a digit (e.g. MY_VAR)",
            )
        if key in RANK_VARIABLES:
            raise SpecError(
                where,
                "is set by the provider for each rank (node rank, IPs, world size) and cannot be overridden; "
                "rename your variable",
            )
        out[key] = _coerce_value(raw, where, f"set it here or pass it in {section}= when creating the task")
    return out


def is_bucket_source(source: str) -> bool:
    """A URL source (``s3://``, ``gs://``, ``r2://``, ``https://`` ...) is a remote store, not a local path."""
    return bool(_URL.match(source))


def _parse_file_mounts(value: object) -> dict[str, str]:
    section = "file_mounts"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(
            section, f"must be a mapping of REMOTE_PATH: LOCAL_PATH_OR_URL, got {_type_name(value)} {value!r}"
        )
    out: dict[str, str] = {}
    for dest, src in value.items():
        where = f"{section}.{dest}"
        if not isinstance(dest, str) or not (dest.startswith("/") or dest.startswith("~/")):
            raise SpecError(
                where,
                "the key is the destination on the node and must be an absolute path or start with '~/' "
                "(e.g. /data or ~/data); the value is the local path or URL",
            )
        if ".." in dest.split("/"):
            raise SpecError(
                where,
                "a '..' segment may not be in a destination: it could leave the node's home (or the "
                "directory named); write the path without '..', e.g. ~/data or /data",
            )
        if not isinstance(src, str) or not src.strip():
            raise SpecError(
                where,
                f"source must be a local path or a URL string such as s3://bucket/path, got {src!r} "
                "(storage-object mounts are not supported)",
            )
        out[dest] = src.strip()
    return out


# ---------------------------------------------------------------------------------------------------------
# the task


@dataclass(frozen=True)
class TaskSpec:
    """One validated gang task. Build it with :func:`parse_task`, :func:`load_task_yaml` or :func:`task_from_args`."""

    run: str
    num_nodes: int = 1
    name: str | None = None
    resources: Resources = field(default_factory=Resources)
    setup: str | None = None
    envs: dict[str, str] = field(default_factory=dict)
    secrets: dict[str, str] = field(default_factory=dict, repr=False)
    workdir: str | None = None
    file_mounts: dict[str, str] = field(default_factory=dict)
    #: SkyPilot's alternatives (``any_of`` / ``ordered`` / several accelerators), in the order written, when
    #: there are two or more; ``resources`` is then the first. Empty: ``resources`` is the only choice.
    alternatives: tuple[Resources, ...] = ()

    @property
    def resource_choices(self) -> tuple[Resources, ...]:
        """Every acceptable ``resources``, in order of preference (one when there are no alternatives)."""
        return self.alternatives or (self.resources,)

    def with_resources(self, resources: Resources) -> TaskSpec:
        """This task with one of its alternatives chosen (what a backend provisions)."""
        return replace(self, resources=resources, alternatives=())

    def __repr__(self) -> str:
        # Secret names help debugging; their values must never reach a log through repr() or str().
        secrets = {k: "<redacted>" for k in self.secrets}
        return (
            f"TaskSpec(run={self.run!r}, num_nodes={self.num_nodes!r}, name={self.name!r}, "
            f"resources={self.resources!r}, setup={self.setup!r}, envs={self.envs!r}, secrets={secrets!r}, "
            f"workdir={self.workdir!r}, file_mounts={self.file_mounts!r}, alternatives={self.alternatives!r})"
        )

    __str__ = __repr__

    def to_dict(self, include_secrets: bool = False) -> dict[str, Any]:
        """A SkyPilot-YAML-shaped dict (only what is set); it parses back to an equal spec."""
        out: dict[str, Any] = {}
        if self.name is not None:
            out["name"] = self.name
        out["num_nodes"] = self.num_nodes
        if self.alternatives:
            out["resources"] = {"ordered": [_resources_to_dict(r) for r in self.alternatives]}
        elif resources := _resources_to_dict(self.resources):
            out["resources"] = resources
        if self.workdir is not None:
            out["workdir"] = self.workdir
        if self.file_mounts:
            out["file_mounts"] = dict(self.file_mounts)
        if self.setup is not None:
            out["setup"] = self.setup
        out["run"] = self.run
        if self.envs:
            out["envs"] = dict(self.envs)
        if self.secrets:
            out["secrets"] = {k: (v if include_secrets else "<redacted>") for k, v in self.secrets.items()}
        return out

    def redacted(self, text: str) -> str:
        """``text`` with every secret value replaced by ``***``, for logs and error messages."""
        values = sorted({v for v in self.secrets.values() if v}, key=len, reverse=True)
        if not values:
            return text
        # One alternation, longest first, so a secret that contains another is hidden whole.
        return re.sub("|".join(re.escape(v) for v in values), "***", text)


def _parse_script(value: object, where: str, required: bool) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        if required:
            raise SpecError(
                where, "required: give the shell commands every node runs, e.g. run: python train.py"
            )
        return None
    if not isinstance(value, str):
        raise SpecError(
            where,
            f"must be a string of shell commands, got {_type_name(value)}; "
            "join several commands with newlines using a YAML block ('|')",
        )
    if "\0" in value:
        raise SpecError(where, "contains a NUL byte, which a shell script cannot hold; remove it")
    return value


def _parse_num_nodes(value: object) -> int:
    where = "num_nodes"
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str):
            hint = (
                f"write it unquoted, e.g. num_nodes: {value.strip()}" if value.strip().isdigit() else "e.g. 4"
            )
        else:
            hint = "e.g. num_nodes: 4"
        raise SpecError(where, f"must be a whole number >= 1, got {_type_name(value)} {value!r}; {hint}")
    if value < 1:
        raise SpecError(where, f"must be at least 1, got {value}; a gang needs one or more nodes")
    return value


def _merge(base: Mapping[str, object], overrides: Mapping[str, object] | None) -> dict[str, object]:
    merged = dict(base)
    for key, value in (overrides or {}).items():
        if value is None:  # an argument left at its default: keep what the YAML says
            continue
        old = merged.get(key)
        if key == "resources" and isinstance(old, Mapping) and isinstance(value, (Mapping, Resources)):
            merged[key] = _merge_resources(old, value)
        elif key in ("envs", "secrets") and isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = {**old, **value}
        elif key in ("envs", "secrets") and old is not None and not isinstance(old, Mapping):
            continue  # keep the bad base value so its own error is reported
        else:
            merged[key] = value
    return merged


def _merge_resources(
    base: Mapping[str, object], override: Mapping[str, object] | Resources
) -> dict[str, object]:
    """``resources`` given as an argument over the YAML's, key by key: the argument's keys win (also inside
    the YAML's ``any_of`` / ``ordered`` entries), the YAML's other keys stay; a key given as ``None``
    removes the YAML's."""
    if isinstance(override, Resources):
        override = _resources_to_dict(override)
    removed = {k for k, v in override.items() if v is None}
    given = {k: v for k, v in override.items() if v is not None}
    merged = _overlay({k: v for k, v in base.items() if k not in removed}, given)
    if any(k in given for k in ALTERNATIVE_KEYS):
        for key in ALTERNATIVE_KEYS:
            if key not in given:
                merged.pop(key, None)  # the argument's alternatives replace the YAML's
    for key in ALTERNATIVE_KEYS:
        entries = merged.get(key)
        if key in given or not isinstance(entries, (list, tuple)):
            continue
        merged[key] = [
            _overlay({k: v for k, v in e.items() if k not in removed}, given) if isinstance(e, Mapping) else e
            for e in entries
        ]
    return merged


def parse_task(obj: Mapping[str, object], *, overrides: Mapping[str, object] | None = None) -> TaskSpec:
    """Parse a SkyPilot task YAML mapping as is.

    ``overrides`` (Python arguments) replace top-level keys; ``envs``/``secrets`` are merged (override wins),
    and so is ``resources``, key by key (see :func:`_merge_resources`). A ``None`` override means "not
    given" and leaves the YAML value alone.
    """
    if not isinstance(obj, Mapping):
        raise SpecError(
            "task", f"must be a mapping of task keys (run, num_nodes, ...), got {_type_name(obj)}"
        )
    if overrides is not None and not isinstance(overrides, Mapping):
        raise SpecError("overrides", f"must be a mapping of task keys, got {_type_name(overrides)}")
    _check_keys("", obj, TOP_LEVEL_KEYS, _SKYPILOT_ONLY_TOP)
    if overrides:
        _check_keys("", overrides, TOP_LEVEL_KEYS, _SKYPILOT_ONLY_TOP)
    data = _merge(obj, overrides)

    run = _parse_script(data.get("run"), "run", required=True)
    assert run is not None  # required=True raised otherwise
    name = data.get("name")
    if name is not None and (not isinstance(name, str) or not _TASK_NAME.match(name)):
        raise SpecError(
            "name",
            f"{name!r} is not a valid task name; use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (e.g. train-llm)",
        )
    envs = _parse_env_mapping(data.get("envs"), "envs")
    secrets = _parse_env_mapping(data.get("secrets"), "secrets")
    clash = sorted(envs.keys() & secrets.keys())
    if clash:
        raise SpecError(
            f"secrets.{clash[0]}", "is also set in envs; keep it in secrets only (values there are redacted)"
        )
    options = _parse_resource_options(data.get("resources"))
    return TaskSpec(
        run=run,
        num_nodes=_parse_num_nodes(data.get("num_nodes", 1)),
        name=name,
        resources=options[0],
        alternatives=options if len(options) > 1 else (),
        setup=_parse_script(data.get("setup"), "setup", required=False),
        envs=envs,
        secrets=secrets,
        workdir=_opt_str(data.get("workdir"), "workdir", "a local directory synced to every node"),
        file_mounts=_parse_file_mounts(data.get("file_mounts")),
    )


def task_from_args(**kwargs: object) -> TaskSpec:
    """The YAML fields as Python keyword arguments (``resources`` may be a dict or a :class:`Resources`)."""
    return parse_task(kwargs)


# ---------------------------------------------------------------------------------------------------------
# YAML files


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys: PyYAML keeps the last silently, hiding e.g. a second ``run:``."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable: the base class reports it
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found duplicate key {key!r}",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _resolve_local(path: str, base_dir: str) -> str:
    if is_bucket_source(path) or os.path.isabs(path) or path.startswith("~"):
        return path
    return os.path.normpath(os.path.join(base_dir, path))


def load_task_yaml(
    path: str | os.PathLike[str], *, overrides: Mapping[str, object] | None = None
) -> TaskSpec:
    """Read a task YAML file; relative ``workdir`` and local ``file_mounts`` sources resolve against its directory.

    File problems (missing, unreadable, invalid YAML, not a mapping) are a SpecError whose field is the path;
    spec errors inside the file name the path at the end of the message.
    """
    where = os.fspath(path)
    try:
        with open(where, encoding="utf-8") as fh:
            doc = yaml.load(fh, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects
    except FileNotFoundError:
        raise SpecError(
            where, "task YAML file not found; check the path (relative paths use the current directory)"
        ) from None
    except IsADirectoryError:
        raise SpecError(where, "is a directory; give the path of the task YAML file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SpecError(
            where, f"cannot read the task YAML file ({err}); check permissions and that it is UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise SpecError(where, f"invalid YAML: {err}; fix the syntax at the position shown") from None
    if not isinstance(doc, Mapping):
        raise SpecError(
            where,
            f"the YAML document must be a mapping of task keys (run, num_nodes, ...), got {_type_name(doc)}",
        )

    base_dir = os.path.dirname(os.path.abspath(where))
    data: dict[str, object] = dict(doc)
    if isinstance(data.get("workdir"), str) and str(data["workdir"]).strip():
        data["workdir"] = _resolve_local(str(data["workdir"]).strip(), base_dir)
    mounts = data.get("file_mounts")
    if isinstance(mounts, Mapping):
        data["file_mounts"] = {
            dest: _resolve_local(src.strip(), base_dir) if isinstance(src, str) and src.strip() else src
            for dest, src in mounts.items()
        }
    try:
        return parse_task(data, overrides=overrides)
    except SpecError as err:
        raise SpecError(err.field, f"{err.message} (in {where})") from None


# ---------------------------------------------------------------------------------------------------------
# backends


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can honour, so a request it would silently drop is refused before launch."""

    name: str
    max_nodes: int
    supported_resources: frozenset[str]
    clouds: frozenset[str]
    supports_bucket_mounts: bool = False


#: why a backend that runs on machines it does not choose cannot honour a field (shown with "remove it")
_WHY_NOT = {
    "use_spot": "its machines are not bought, so there are no spot instances to ask for",
    "instance_type": "it does not choose machines, so there is no instance type to pick",
    "disk_size": "it does not create disks",
    "region": "it does not choose where machines are",
    "zone": "it does not choose where machines are",
    "image_id": "it runs commands on the machines as they are; images are run by the kubernetes backend "
    "(a sky_kubernetes connection)",
}


def describe_resources(res: Resources) -> str:
    """One alternative in a line: ``H100:8, cpus 8+, infra k8s`` (``no particular resources`` if empty)."""
    parts = []
    if res.accelerators is not None:
        parts.append(str(res.accelerators))
    for key, value in res.requested().items():
        if key != "accelerators":
            parts.append(f"{key} {value}")
    return ", ".join(parts) or "no particular resources"


def resource_problems(
    res: Resources, caps: BackendCapabilities, backends: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """(field, why) for every field of ``res`` the backend cannot honour; empty: it can.

    ``backends``: the backends this provider has (kind -> connection type), so an error names one only
    when it exists.
    """
    problems: list[tuple[str, str]] = []
    requested = res.requested()
    cloud = requested.pop("cloud", None)
    if isinstance(cloud, str) and cloud not in caps.clouds:
        accepted = ", ".join(sorted(caps.clouds)) or "none"
        if backends and cloud in backends and cloud != caps.name:
            hint = f"remove cloud/infra, or run it with a {backends[cloud]} connection (the {cloud} backend)"
        else:
            hint = (
                f"remove cloud/infra to run on the {caps.name} backend's machines; no backend of this "
                f"provider runs on {cloud!r}"
            )
        problems.append(
            (
                "resources.cloud",
                f"the {caps.name} backend cannot run on cloud {cloud!r} (it accepts: {accepted}); {hint}",
            )
        )
    for key, value in requested.items():
        if problems and key in ("region", "zone"):
            continue  # parts of the refused cloud's infra: removing cloud/infra removes them too
        if key not in caps.supported_resources:
            why = _WHY_NOT.get(key)
            reason = f"{why}; remove it" if why else "remove it"
            problems.append(
                (f"resources.{key}", f"the {caps.name} backend cannot honour {key} ({value}); {reason}")
            )
    return problems


def _spec_problems(spec: TaskSpec, caps: BackendCapabilities) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    if spec.num_nodes > caps.max_nodes:
        problems.append(
            (
                "num_nodes",
                f"the {caps.name} backend runs at most {caps.max_nodes} node(s), got {spec.num_nodes}; "
                "lower num_nodes or give the backend more nodes",
            )
        )
    if not caps.supports_bucket_mounts:
        for dest, src in spec.file_mounts.items():
            if is_bucket_source(src):
                problems.append(
                    (
                        f"file_mounts.{dest}",
                        f"the {caps.name} backend cannot mount bucket {src!r}; copy it in setup "
                        "(e.g. with aws s3 cp) or pick a backend with bucket mounts",
                    )
                )
    return problems


def problems_error(backend: str, problems: Sequence[tuple[str, str]]) -> SpecError:
    """One error for every problem at once: a single one as it is, several listed with their fields."""
    if len(problems) == 1:
        return SpecError(*problems[0])
    fields_text = ", ".join(f for f, _ in problems)
    listed = "; ".join(f"{f}: {m}" for f, m in problems)
    return SpecError(
        fields_text, f"the {backend} backend cannot honour {len(problems)} fields of this task: {listed}"
    )


def check_backend(
    spec: TaskSpec, caps: BackendCapabilities, backends: Mapping[str, str] | None = None
) -> None:
    """Raise one SpecError naming everything ``caps`` cannot honour (nothing the user asked for is dropped).

    ``cloud`` is checked against ``caps.clouds`` (not ``supported_resources``); every other requested
    resources field must be in ``supported_resources``. With alternatives (``any_of``, ``ordered``, several
    accelerators) one that the backend can honour is enough; none is an error listing each one's problems.
    """
    problems = _spec_problems(spec, caps)
    choices = spec.resource_choices
    per_choice = [resource_problems(r, caps, backends) for r in choices]
    if len(choices) == 1:
        problems += per_choice[0]
    elif all(per_choice):
        problems.append(
            (
                "resources",
                f"none of the {len(choices)} alternatives can run on the {caps.name} backend: "
                + " | ".join(
                    f"#{i + 1} ({describe_resources(r)}): " + "; ".join(m for _, m in p)
                    for i, (r, p) in enumerate(zip(choices, per_choice, strict=True))
                ),
            )
        )
    if problems:
        raise problems_error(caps.name, problems)
