"""``resources``: accelerators, cpus, memory, disk, infra, labels and their alternatives (any_of / ordered)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from airflow_provider_sky.spec.common import (
    _ACCEL_NAME,
    _CLOUD_ALIASES,
    _CLOUD_NAME,
    _CONTEXT_CLOUDS,
    _CONTROL,
    _CPUS,
    _ENTRY_KEYS,
    _LABEL_NAME,
    _MEMORY,
    _MEMORY_UNIT_GIB,
    _NUMBER,
    _SKYPILOT_ONLY_RESOURCES,
    ALTERNATIVE_KEYS,
    RESOURCE_KEYS,
    SpecError,
    _check_keys,
    _coerce_value,
    _fmt_number,
    _opt_str,
    _type_name,
)

# ---------------------------------------------------------------------------------------------------------
# accelerators


@dataclass(frozen=True)
class Accelerator:
    """An accelerator request as the user wrote it; fractions are kept so status can show ``V100:0.5``."""

    name: str
    count: float = 1.0

    def __post_init__(self) -> None:
        # Validated here too, so a directly built Accelerator cannot carry a zero or negative count.
        if not isinstance(self.name, str) or not _ACCEL_NAME.fullmatch(self.name):
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
    if not _ACCEL_NAME.fullmatch(name):
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
    #: SkyPilot's disk and network tiers (``best``, ...): accepted, honoured by no backend yet (a warning)
    disk_tier: str | None = None
    network_tier: str | None = None
    #: ports to open to the outside, each ``"8080"`` or a range ``"10000-10010"``
    ports: tuple[str, ...] = ()

    def requested(self) -> dict[str, object]:
        """The fields the user set (non-default), so a backend can refuse what it cannot honour."""
        out: dict[str, object] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value is False or (f.name in ("labels", "ports") and not value):
                continue
            if f.name == "labels":
                value = dict(value)
            elif f.name == "ports":
                value = ",".join(value)
            out[f.name] = value
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
        m = pattern.fullmatch(value.strip())
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
    if not _CLOUD_NAME.fullmatch(cloud):
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
    if _CONTROL.search(text):
        raise SpecError(where, f"{value!r} contains a control character (newline, NUL, ...); {fix}")
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
        if not isinstance(key, str) or not _LABEL_NAME.fullmatch(key):
            raise SpecError(
                where,
                "label names must be non-empty strings of at most 128 characters, without control "
                f"characters (newline, NUL, ...) or spaces at either end, e.g. team; got {key!r}",
            )
        text = _coerce_value(raw, f"{where}.{key}", "give the label a value, e.g. team: ml")
        if _CONTROL.search(text):
            raise SpecError(
                f"{where}.{key}", f"{text!r} contains a control character (newline, ...); remove it"
            )
        out[key] = text
    return out


def _resources_as_mapping(value: Resources) -> dict[str, object]:
    """A directly built Resources goes through the same parser, so it is validated and normalised too."""
    out: dict[str, object] = {f.name: getattr(value, f.name) for f in fields(value)}
    return out


_DISK = re.compile(r"(\d+)\s*(?:(?P<unit>[GT])(?:IB|I|B)?)?", re.IGNORECASE)


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
    elif isinstance(value, str) and (m := _DISK.fullmatch(value.strip())):
        size = int(m.group(1)) * (1024 if (m.group("unit") or "G").upper() == "T" else 1)
    else:
        raise SpecError("resources.disk_size", fix)
    if size <= 0:
        raise SpecError("resources.disk_size", fix)
    return size


#: SkyPilot's tiers, best last
DISK_TIERS = ("low", "medium", "high", "ultra", "best")
NETWORK_TIERS = ("standard", "best")


def _parse_tier(value: object, key: str, allowed: tuple[str, ...]) -> str | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in allowed:
        return value.strip().lower()
    raise SpecError(f"resources.{key}", f"must be one of {', '.join(allowed)}; got {value!r}")


_PORT_RANGE = re.compile(r"(\d+)(?:\s*-\s*(\d+))?")


def _parse_ports(value: object) -> tuple[str, ...]:
    """SkyPilot's ``ports``: one port (``8080``), a range (``"10000-10010"``) or a list of those."""
    where = "resources.ports"
    fix = "give a port (8080), a range ('10000-10010') or a list of them ([8080, '9000-9010']), each 1-65535"
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    out: list[str] = []
    for item in items:
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise SpecError(where, f"{fix}; got {_type_name(item)} {item!r}")
        m = _PORT_RANGE.fullmatch(str(item).strip())
        if not m:
            raise SpecError(where, f"{fix}; got {item!r}")
        low = int(m.group(1))
        high = int(m.group(2)) if m.group(2) else low
        if not 1 <= low <= high <= 65535:
            raise SpecError(where, f"{fix}; got {item!r}")
        text = str(low) if low == high else f"{low}-{high}"
        if text not in out:
            out.append(text)
    return tuple(out)


def _alias_gpus(value: Mapping[str, object], where: str) -> Mapping[str, object]:
    """SkyPilot's ``gpus`` is another name for ``accelerators``: one mapping may give only one of them."""
    if "gpus" not in value:
        return value
    if value.get("gpus") is not None and value.get("accelerators") is not None:
        raise SpecError(
            f"{where}.gpus",
            "gpus is SkyPilot's other name for accelerators and both are given; keep one of them",
        )
    out = {k: v for k, v in value.items() if k != "gpus"}
    if value.get("gpus") is not None or "accelerators" not in value:
        out["accelerators"] = value.get("gpus")
    return out


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
        disk_tier=_parse_tier(value.get("disk_tier"), "disk_tier", DISK_TIERS),
        network_tier=_parse_tier(value.get("network_tier"), "network_tier", NETWORK_TIERS),
        ports=_parse_ports(value.get("ports")),
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
    value = _alias_gpus(value, where)
    given = [k for k in ALTERNATIVE_KEYS if value.get(k) is not None]
    if len(given) > 1:
        raise SpecError(
            "resources.ordered",
            "give any_of or ordered, not both (both list alternatives, tried in order here)",
        )
    # autostop is the task's (``TaskSpec.autostop``, parsed by ``parse_task``), not one alternative's
    base = {k: v for k, v in value.items() if k not in ALTERNATIVE_KEYS and k != "autostop"}
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
            entries.append((prefix, _overlay(base, _alias_gpus(entry, prefix))))
    out: list[Resources] = []
    for prefix, entry in entries:
        try:
            for one in _per_region_images(entry):
                for acc in _parse_accelerator_options(one.get("accelerators")):
                    res = _build_resources(one, acc)
                    if res not in out:
                        out.append(res)
        except SpecError as err:
            raise _renamed(err, prefix) from None
    return tuple(out)


def _per_region_images(entry: Mapping[str, object]) -> list[Mapping[str, object]]:
    """SkyPilot's per-region ``image_id: {us-east-1: ami-1, us-west-2: ami-2}``: the task runs in one of
    those regions with its image. With a region given (``region`` / ``infra``) that region's image; else
    one alternative per region, in the order written (the first the backend can run in wins)."""
    images = entry.get("image_id")
    if not isinstance(images, Mapping):
        return [entry]
    where = "resources.image_id"
    if not images:
        raise SpecError(where, "is an empty mapping; give region: image pairs, or one image id")
    for region, image in images.items():
        if (
            not isinstance(region, str)
            or not region.strip()
            or not isinstance(image, str)
            or not image.strip()
        ):
            raise SpecError(
                where,
                f"a per-region image_id maps region names to image ids (e.g. us-east-1: ami-0123), got "
                f"{region!r}: {image!r}",
            )
    region = entry.get("region")
    if region is None and entry.get("infra") is not None:
        region = _parse_infra(entry["infra"])[1]
    if region is not None:
        if region not in images:
            raise SpecError(
                where,
                f"has no image for region {region!r} (it names {', '.join(map(str, images))}); add one, or "
                "give another region",
            )
        return [{**entry, "image_id": images[region]}]
    return [{**entry, "region": r, "image_id": img} for r, img in images.items()]


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
    for key in ("disk_tier", "network_tier"):
        if getattr(res, key) is not None:
            out[key] = getattr(res, key)
    if res.ports:
        out["ports"] = list(res.ports)
    return out
