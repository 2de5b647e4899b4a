"""GPUs of a machine: found with ``nvidia-smi`` / ``rocm-smi`` or declared, named the way SkyPilot names them,
and handed out to nodes. No I/O here except :func:`detect_local`; the SSH backend runs :data:`DETECT_SCRIPT`
on each host and parses its output with :func:`parse_detect_output`.

Names: SkyPilot calls GPUs by short canonical names (``A100``, ``A100-80GB``, ``H100``, ``L4``, ``T4``,
``MI300X``); ``nvidia-smi`` says ``NVIDIA A100-SXM4-80GB`` or ``Tesla T4``. :func:`canonical_name` maps the
one to the other with a small table (memory tells ``A100`` from ``A100-80GB`` and ``V100`` from
``V100-32GB``); names are compared case-insensitively, and ``A100`` is not ``A100-80GB``, as in SkyPilot.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from airflow_provider_sky.node.scripts import load

__all__ = [
    "DETECT_SCRIPT",
    "GpuDevice",
    "Inventory",
    "canonical_name",
    "declared_inventory",
    "detect_local",
    "pack",
    "parse_declared",
    "parse_detect_output",
    "parse_nvidia_smi",
    "parse_rocm_smi",
    "same_name",
]

#: prints ``@nvidia`` / ``@rocm`` sections; a tool that is there but fails says so (``@failed <code>``)
DETECT_SCRIPT = load("detect_gpus.sh")

# Canonical names, most specific first: the first whose pattern is in the tool's name wins.
# (pattern, canonical name, memory in MiB above which the large variant applies, large variant)
_NVIDIA: tuple[tuple[str, str, int, str], ...] = (
    ("GH200", "GH200", 0, ""),
    ("GB200", "GB200", 0, ""),
    ("B200", "B200", 0, ""),
    ("B100", "B100", 0, ""),
    ("H200", "H200", 0, ""),
    ("H100", "H100", 0, ""),
    ("A100", "A100", 50_000, "A100-80GB"),
    ("A10G", "A10G", 0, ""),
    ("A10", "A10", 0, ""),
    ("A40", "A40", 0, ""),
    ("A30", "A30", 0, ""),
    ("A16", "A16", 0, ""),
    ("L40S", "L40S", 0, ""),
    ("L40", "L40", 0, ""),
    ("L4", "L4", 0, ""),
    ("V100", "V100", 20_000, "V100-32GB"),
    ("P100", "P100", 0, ""),
    ("P40", "P40", 0, ""),
    ("P4", "P4", 0, ""),
    ("T4G", "T4g", 0, ""),
    ("T4", "T4", 0, ""),
    ("K80", "K80", 0, ""),
    ("M60", "M60", 0, ""),
)
_PREFIXES = ("NVIDIA ", "TESLA ", "GEFORCE ", "QUADRO ", "AMD ", "INSTINCT ", "RADEON ")
_AMD = re.compile(r"\bMI\d{2,3}[A-Z]?\b", re.IGNORECASE)


def canonical_name(raw: str, memory_mib: int | None = None) -> str:
    """``NVIDIA A100-SXM4-80GB`` -> ``A100-80GB``, ``Tesla T4`` -> ``T4``, ``AMD Instinct MI300X OAM`` ->
    ``MI300X``; a GPU outside the table keeps its name without the vendor words (``RTX A6000`` ->
    ``RTXA6000``, as SkyPilot's Kubernetes labels do)."""
    text = " ".join(raw.split())
    upper = text.upper()
    amd = _AMD.search(upper)
    if amd:
        return amd.group(0).upper()
    for pattern, name, big_mib, big_name in _NVIDIA:
        if re.search(rf"(?<![A-Z0-9]){re.escape(pattern)}(?![A-Z0-9])", upper):
            if big_name and (
                (memory_mib is not None and memory_mib > big_mib) or big_name.rsplit("-", 1)[1] in upper
            ):
                return big_name
            return name
    rest = text
    changed = True
    while changed:
        changed = False
        for prefix in _PREFIXES:
            if rest.upper().startswith(prefix):
                rest = rest[len(prefix) :]
                changed = True
    rest = re.sub(r"^RTX[ -]", "RTX", rest.strip(), flags=re.IGNORECASE)
    return re.sub(r"\s+", "-", rest) or text


#: the canonical names of the table above (AMD's ``MI<nnn>`` are matched by pattern)
KNOWN_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys(n for _, name, _, big in _NVIDIA for n in (name, big) if n)
) + ("MI100", "MI210", "MI250", "MI250X", "MI300A", "MI300X", "MI325X")


def known_name(name: str) -> bool:
    """A GPU name this provider's catalog knows (case-insensitive), as SkyPilot names it."""
    return any(same_name(name, k) for k in KNOWN_NAMES) or bool(_AMD.fullmatch(name.strip()))


def close_names(name: str, others: Iterable[str] = ()) -> list[str]:
    """Known names (and ``others``) close to a mistyped ``name``: ``A1000`` -> ``A100``."""
    pool = {n.upper(): n for n in (*KNOWN_NAMES, *others)}
    return [pool[c] for c in difflib.get_close_matches(name.upper(), list(pool), n=2, cutoff=0.75)]


def same_name(requested: str, have: str) -> bool:
    """Names as SkyPilot compares them: case-insensitive, and exact (``A100`` is not ``A100-80GB``)."""
    return requested.strip().lower() == have.strip().lower()


@dataclass(frozen=True)
class GpuDevice:
    """One GPU: its device index (what ``CUDA_VISIBLE_DEVICES`` takes), its canonical name, what the tool said."""

    index: int
    name: str
    raw: str = ""
    memory_mib: int | None = None


@dataclass(frozen=True)
class Inventory:
    """The GPUs of one machine and where that knowledge came from (``nvidia-smi``, ``rocm-smi``, ``declared``)."""

    devices: tuple[GpuDevice, ...] = ()
    source: str = "none"
    #: why no GPU was found, when a tool was there but failed (shown in errors)
    note: str = ""

    def matching(self, name: str) -> list[GpuDevice]:
        return [d for d in self.devices if same_name(name, d.name)]

    def describe(self) -> str:
        """``8x H100 (nvidia-smi)``, ``2x A100, 2x T4 (declared)``, ``no GPUs (nvidia-smi: No devices ...)``."""
        if not self.devices:
            why = f" ({self.note})" if self.note else ""
            return f"no GPUs{why}"
        counts: dict[str, int] = {}
        for d in self.devices:
            counts[d.name] = counts.get(d.name, 0) + 1
        return ", ".join(f"{n}x {name}" for name, n in counts.items()) + f" ({self.source})"

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "note": self.note,
            "devices": [[d.index, d.name, d.raw, d.memory_mib] for d in self.devices],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> Inventory:
        devices = data.get("devices") or []
        assert isinstance(devices, list)
        return cls(
            tuple(
                GpuDevice(int(i), str(n), str(r or ""), None if m is None else int(m))
                for i, n, r, m in devices
            ),
            str(data.get("source") or "none"),
            str(data.get("note") or ""),
        )


# ---------------------------------------------------------------------------------------------------------
# parsing what the tools print


def _int(text: str) -> int | None:
    m = re.search(r"\d+", text)
    return int(m.group(0)) if m else None


def parse_nvidia_smi(text: str) -> list[GpuDevice]:
    """``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`` lines
    (``0, NVIDIA A100-SXM4-80GB, 81920``; a ``MiB`` unit or a header line is tolerated)."""
    out: list[GpuDevice] = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2 or not parts[0].isdigit():
            continue  # the header, a blank line, a warning
        memory = _int(parts[2]) if len(parts) > 2 else None
        raw = parts[1]
        out.append(GpuDevice(int(parts[0]), canonical_name(raw, memory), raw, memory))
    return out


_ROCM_NAME = re.compile(r"GPU\[(\d+)\]\s*:\s*(?:Card [Ss]eries|Marketing Name)\s*:\s*(.+)")
_ROCM_VRAM = re.compile(r"GPU\[(\d+)\]\s*:\s*VRAM Total Memory \(B\)\s*:\s*(\d+)")


def parse_rocm_smi(text: str) -> list[GpuDevice]:
    """``rocm-smi --showproductname --showmeminfo vram``: ``GPU[0] : Card Series: AMD Instinct MI300X OAM``
    and ``GPU[0] : VRAM Total Memory (B): 206158430208`` lines (the first name line per GPU wins)."""
    names: dict[int, str] = {}
    memory: dict[int, int] = {}
    for line in text.splitlines():
        m = _ROCM_NAME.search(line)
        if m and int(m.group(1)) not in names:
            names[int(m.group(1))] = m.group(2).strip()
        m = _ROCM_VRAM.search(line)
        if m:
            memory[int(m.group(1))] = int(m.group(2)) // (1024 * 1024)
    return [
        GpuDevice(i, canonical_name(raw, memory.get(i)), raw, memory.get(i))
        for i, raw in sorted(names.items())
    ]


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("@")]
    return lines[0][:160] if lines else ""


def parse_detect_output(text: str) -> Inventory:
    """What :data:`DETECT_SCRIPT` printed, as an inventory. NVIDIA GPUs win when a machine has both tools
    with GPUs (one gang uses one type)."""
    sections: dict[str, str] = {}
    current = ""
    for line in text.splitlines():
        if line in ("@nvidia", "@rocm", "@end"):
            current = line[1:]
            sections.setdefault(current, "")
            continue
        if current:
            sections[current] += line + "\n"
    notes = []
    for tool, parse, label in (
        ("nvidia", parse_nvidia_smi, "nvidia-smi"),
        ("rocm", parse_rocm_smi, "rocm-smi"),
    ):
        if tool not in sections:
            continue
        body = sections[tool]
        devices = parse(body)
        if devices:
            return Inventory(tuple(devices), label)
        failed = re.search(r"^@failed (\d+)", body, re.MULTILINE)
        said = _first_line(body)
        if failed:
            notes.append(f"{label} failed with exit code {failed.group(1)}" + (f": {said}" if said else ""))
        else:
            notes.append(f"{label} lists none" + (f": {said}" if said else ""))
    if not notes:
        notes.append("neither nvidia-smi nor rocm-smi is installed")
    return Inventory((), "none", "; ".join(notes))


def detect_local(timeout: float = 30.0) -> Inventory:
    """This machine's GPUs (the ``nvidia-smi`` / ``rocm-smi`` found on this process's ``PATH``)."""
    try:
        res = subprocess.run(
            ["/bin/sh", "-c", DETECT_SCRIPT], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Inventory((), "none", f"GPU detection failed: {exc}")
    return parse_detect_output(res.stdout + res.stderr)


# ---------------------------------------------------------------------------------------------------------
# declared GPUs (a connection's ``accelerators`` extra)

_DECLARED = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9_.-]*)\s*(?::\s*(\d+))?\s*")
DECLARED_FORMAT = (
    "write NAME:COUNT (e.g. 'H100:8'), several comma-separated ('A100:4, T4:2'), or '' for no GPUs"
)


def parse_declared(value: object, where: str) -> Inventory:
    """``"H100:8"`` (or ``"A100:4, T4:2"``, or ``{"H100": 8}``) as an inventory of devices 0..N-1."""
    items: list[tuple[str, int]] = []
    if isinstance(value, Mapping):
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(
                    f"{where}: count of {k!r} must be a whole number >= 0, got {v!r}; {DECLARED_FORMAT}"
                )
            items.append((str(k), v))
    elif isinstance(value, str):
        for part in (p for p in value.split(",") if p.strip()):
            m = _DECLARED.fullmatch(part)
            if not m:
                raise ValueError(f"{where}: cannot read {part.strip()!r}; {DECLARED_FORMAT}")
            items.append((m.group(1), int(m.group(2) or 1)))
    else:
        raise ValueError(f"{where}: expected a string such as 'H100:8', got {value!r}; {DECLARED_FORMAT}")
    devices: list[GpuDevice] = []
    for name, count in items:
        for _ in range(count):
            devices.append(GpuDevice(len(devices), canonical_name(name), name))
    return Inventory(tuple(devices), "declared", "" if devices else "declared without GPUs")


def declared_inventory(value: object, where: str, hosts: Sequence[str] = ()) -> dict[str, Inventory]:
    """A connection's ``accelerators``: one spec for every host (``"*"``), or JSON ``{host: spec}``.

    ``hosts`` are the names a per-host key may use (``host``, ``host:port``, ``user@host``); a key naming
    none of them is an error, so a typo never silently leaves a host undeclared."""
    if value in (None, ""):
        return {}
    if isinstance(value, str) and value.strip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(
                f"{where}: not valid JSON ({exc}); {DECLARED_FORMAT}, or JSON {{host: spec}}"
            ) from None
    if isinstance(value, Mapping) and value and all(isinstance(v, (str, Mapping)) for v in value.values()):
        out = {}
        for host, spec in value.items():
            if hosts and str(host) not in hosts and str(host) != "*":
                raise ValueError(f"{where}: {host!r} is not one of the hosts ({', '.join(hosts)})")
            out[str(host)] = parse_declared(spec, f"{where}.{host}")
        return out
    return {"*": parse_declared(value, where)}


# ---------------------------------------------------------------------------------------------------------
# handing devices out


@dataclass
class Allocation:
    """Devices per node (node i gets ``per_node[i]``), or why they could not be given."""

    per_node: list[list[int]] = field(default_factory=list)
    problem: str = ""


def pack(free: Sequence[int], count: float, num_nodes: int) -> Allocation:
    """Give ``num_nodes`` nodes ``count`` GPUs each out of ``free`` (device indices, in order).

    A whole count (or more than one, rounded up) gives each node its own devices, disjoint: 2 nodes x 4 on
    ``0..7`` are ``0,1,2,3`` and ``4,5,6,7``. A fraction below one shares a device between nodes, as Ray
    and SkyPilot share one: 4 nodes x 0.5 on ``0,1`` are ``0``, ``0``, ``1``, ``1``.
    """
    free = list(free)
    if count >= 1 or count <= 0:
        each = max(1, math.ceil(count))
        need = each * num_nodes
        if need > len(free):
            return Allocation(problem=f"needs {need} ({num_nodes} node(s) x {each}), {len(free)} free")
        return Allocation([free[i * each : (i + 1) * each] for i in range(num_nodes)])
    per_device = max(1, math.floor(1 / count + 1e-9))
    need = math.ceil(num_nodes / per_device)
    if need > len(free):
        return Allocation(
            problem=f"needs {need} ({num_nodes} node(s) x {count:g}, {per_device} per device), {len(free)} free"
        )
    return Allocation([[free[i // per_device]] for i in range(num_nodes)])


def indices_text(devices: Iterable[int]) -> str:
    return ",".join(str(d) for d in devices)
