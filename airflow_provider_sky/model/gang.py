"""Gang policy, no I/O: rank order, the env contract, how a rank's state is classified, root cause."""

from __future__ import annotations

import ipaddress
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import TypeVar

# how a hung rank's reason starts ("hung: no output for 600 s (ranks 1, 3)"): the head agent writes it too
from airflow_provider_sky.agent.node import HUNG_PREFIX as HUNG_PREFIX
from airflow_provider_sky.node.exitcodes import describe_exit
from airflow_provider_sky.node.runtime import RawRankStatus

DEFAULT_MASTER_PORT = "29500"
#: the attempt of the whole gang a rank belongs to, 1 first (SKYPILOT_TASK_ID stays the same)
ATTEMPT_ENV = "SKY_ATTEMPT"
#: set on a node whose GPUs the backend hands out (the local backend's share of this machine, an SSH host's)
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"


class RankState(str, Enum):
    """A rank's state as users see it. A ``str``: it equals, hashes and prints as its plain value
    (``RankState.FAILED == "failed"``); what goes over the wire (JSON, trigger events, XCom) is that
    value (``RankStatus.to_dict``), read back with ``RankState(value)``."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    LOST = "lost"
    RUNNING = "running"
    PENDING = "pending"
    #: the node did not answer this poll (``watch.watch`` reads it as running, or lost once it lasts)
    UNKNOWN = "unknown"

    def __str__(self) -> str:
        # "failed", never "RankState.FAILED", in str() and f-strings (3.11+ formats a str mixin with str())
        return self.value


#: the members under their old module-level names, for ``from airflow_provider_sky.model.gang import FAILED``
SUCCEEDED = RankState.SUCCEEDED
FAILED = RankState.FAILED
CANCELLED = RankState.CANCELLED
LOST = RankState.LOST
RUNNING = RankState.RUNNING
PENDING = RankState.PENDING
UNKNOWN = RankState.UNKNOWN
#: terminal rank states; the others are running, pending and unknown
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED, LOST})
BAD = frozenset({FAILED, LOST})

ORPHANED_REASON = (
    "orphaned: nothing polled this job for its orphan_timeout (Airflow lost track of it), so the node's "
    "dead-man's switch killed its processes"
)


def _ip_key(ip: str) -> tuple[int, int | str]:
    try:
        return (0, int(ipaddress.ip_address(ip)))
    except ValueError:
        return (1, ip)


Address = TypeVar("Address", str, tuple[str, int])


def _address_key(node: str | tuple[str, int]) -> tuple[tuple[int, int | str], int]:
    if isinstance(node, str):
        return (_ip_key(node), 0)
    return (_ip_key(node[0]), node[1])


def rank_order(nodes: Sequence[Address], head: Address | None = None) -> list[Address]:
    """Head first (rank 0), then workers sorted numerically by IP (10.0.0.9 before 10.0.0.10).

    A node is an IP, or an ``(ip, port)`` pair when several nodes share an IP (the port breaks ties).
    """
    if not nodes:
        return []
    first: Address = nodes[0] if head is None else head
    if first not in nodes:
        raise ValueError(f"head {first!r} is not one of the nodes {list(nodes)}")
    workers = sorted((n for n in nodes if n != first), key=_address_key)
    workers.insert(0, first)
    return workers


def cluster_info_json(cluster_name: str, cloud: str, region: str | None, zone: str | None) -> str:
    """``SKYPILOT_CLUSTER_INFO``: the same keys SkyPilot sets."""
    return json.dumps({"cluster_name": cluster_name, "cloud": cloud, "region": region, "zone": zone})


def run_env(
    *,
    rank: int,
    ips: Sequence[str],
    task_id: str,
    cluster_info: str,
    gpus_per_node: int,
    user_envs: Mapping[str, str],
    devices: Sequence[int] | None = None,
) -> dict[str, str]:
    """The env of one rank in the run stage: user envs plus the SkyPilot and torch contract.

    ``devices``: the GPUs the backend gave this node (``CUDA_VISIBLE_DEVICES``); None when it gives none
    (no GPUs asked, or a backend whose runtime sets it, as Kubernetes' device plugin does).
    """
    env = dict(user_envs)
    env.setdefault("MASTER_PORT", DEFAULT_MASTER_PORT)
    n = str(len(ips))
    env.update(
        {
            "SKYPILOT_NODE_RANK": str(rank),
            "SKYPILOT_NODE_IPS": "\n".join(ips),
            "SKYPILOT_NUM_NODES": n,
            "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus_per_node),
            "SKYPILOT_TASK_ID": task_id,
            "SKYPILOT_CLUSTER_INFO": cluster_info,
            # 1 here; a later attempt of the whole gang (``retries``) gets its number (runtime_retry)
            ATTEMPT_ENV: "1",
            "MASTER_ADDR": ips[0],
            "WORLD_SIZE": n,
            "NNODES": n,
            "NODE_RANK": str(rank),
            "RANK": str(rank),
        }
    )
    if devices is not None:
        env[CUDA_VISIBLE_DEVICES] = ",".join(str(d) for d in devices)
    return env


def setup_env(
    *,
    rank: int,
    ips: Sequence[str],
    task_id: str,
    cluster_info: str,
    user_envs: Mapping[str, str],
    gpus_per_node: int = 0,
    devices: Sequence[int] | None = None,
) -> dict[str, str]:
    """The env of setup on one node: the setup-stage names, so nobody mistakes them for run ranks."""
    env = dict(user_envs)
    env.update(
        {
            "SKYPILOT_SETUP_NODE_RANK": str(rank),
            "SKYPILOT_SETUP_NODE_IPS": "\n".join(ips),
            "SKYPILOT_NUM_NODES": str(len(ips)),
            "SKYPILOT_SETUP_NUM_GPUS_PER_NODE": str(gpus_per_node),
            "SKYPILOT_TASK_ID": task_id,
            "SKYPILOT_CLUSTER_INFO": cluster_info,
        }
    )
    if devices is not None:
        env[CUDA_VISIBLE_DEVICES] = ",".join(str(d) for d in devices)
    return env


def gpus_per_node(count: float | None) -> int:
    """SkyPilot rounds a fractional accelerator up to a whole device (``V100:0.5`` → 1)."""
    return 0 if not count else int(math.ceil(count))


@dataclass
class RankStatus:
    """One rank as users see it."""

    rank: int
    ip: str
    state: RankState
    exit_code: int | None = None
    start: float | None = None
    end: float | None = None
    reason: str = ""
    log_size: int = 0
    #: when any watcher last polled this rank, by that watcher's clock (None: never)
    polled_at: float | None = None
    #: mtime of the rank's progress file (node clock), None without one: a hang watch's sign of life
    progress: float | None = None

    def __post_init__(self) -> None:
        # a plain value ("failed", from JSON or an older caller) becomes the member; a bad one raises
        self.state = RankState(self.state)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    def to_dict(self) -> dict[str, object]:
        """JSON-ready: the state as its plain string value."""
        d = asdict(self)
        d["state"] = self.state.value
        return d


def classify(raw: RawRankStatus, ip: str, observed_at: float) -> RankStatus:
    """Map what a node reports to a user-facing state: a cancelled sibling is never a bare 137."""
    st = RankStatus(raw.rank, ip, RUNNING, raw.exit_code, raw.start, raw.end, "", raw.log_size)
    st.polled_at = raw.polled_at
    st.progress = raw.progress
    cancelled = "cancelled: " + raw.cancel_reason if raw.cancel_reason else "cancelled"
    if raw.state in ("exited", "badexit"):
        if raw.state == "exited" and raw.exit_code == 0:
            st.state, st.reason = SUCCEEDED, "succeeded"
        elif raw.orphaned:
            st.state, st.reason = FAILED, ORPHANED_REASON
        elif raw.hung:  # killed by the hang watch: the cause, not a cancelled sibling
            reason = raw.cancel_reason
            st.state, st.reason = FAILED, reason if reason.startswith(HUNG_PREFIX) else HUNG_PREFIX.strip()
        elif raw.cancel_requested:
            st.state, st.reason = CANCELLED, cancelled
        elif raw.state == "badexit":
            st.state = FAILED
            st.reason = f"the rank's exit file cannot be read as an exit code: {raw.exit_text.strip()!r}"
        else:
            st.state, st.reason = FAILED, describe_exit(raw.exit_code, "OOMKilled" if raw.oom else None)
    elif raw.state in ("lost", "missing"):
        if raw.cancel_requested:
            st.state, st.reason = CANCELLED, cancelled
        else:
            st.state = LOST
            if raw.state == "missing":
                why = "the rank's job directory is gone"
            else:  # the head agent's word on why, when it found the node lost
                why = raw.cancel_reason or "the rank's process vanished without an exit code"
            st.reason = f"node {ip} lost: {why}"

            st.end = st.end or observed_at
    elif raw.state == "pending":
        st.state = PENDING
    return st


#: ranks up to which the failure message lists every rank's return code (SkyPilot's "Return code list")
CODES_LISTED = 64


def _codes_text(codes: Sequence[object]) -> str:
    """SkyPilot's ``Return code list: [...]``; past :data:`CODES_LISTED` ranks, each code with how many
    ranks ended so (a 1,024-entry list is 18 KB in every rank task's log, and says less)."""
    if len(codes) <= CODES_LISTED:
        return f"Return code list: {codes}"
    counts = Counter(repr(code) for code in codes)
    return f"Return codes of the {len(codes)} ranks: " + ", ".join(f"{c} x{n}" for c, n in counts.items())


@dataclass
class GangStatus:
    """Every rank of one job at one poll."""

    job_id: str
    ranks: list[RankStatus] = field(default_factory=list)
    cancel_requested: bool = False
    #: why the gang was cancelled, when whoever cancelled it said (e.g. a user's mark-failed)
    cancel_reason: str = ""

    @property
    def done(self) -> bool:
        return bool(self.ranks) and all(r.terminal for r in self.ranks)

    @property
    def failed(self) -> bool:
        return any(r.state in BAD for r in self.ranks)

    @property
    def succeeded(self) -> bool:
        return bool(self.ranks) and all(r.state == SUCCEEDED for r in self.ranks)

    def by_rank(self, rank: int) -> RankStatus:
        # polls list ranks in rank order: O(1) then, since each of N rank triggers reads every poll
        if 0 <= rank < len(self.ranks) and self.ranks[rank].rank == rank:
            return self.ranks[rank]
        for r in self.ranks:
            if r.rank == rank:
                return r
        raise KeyError(rank)

    def root_cause(self) -> RankStatus | None:
        """The first failing rank by time (its own end timestamp; ties go to the lower rank)."""
        bad = [r for r in self.ranks if r.state in BAD]
        if not bad:
            return None
        return min(bad, key=lambda r: (r.end if r.end is not None else math.inf, r.rank))

    def failure_message(self) -> str:
        """One line naming the root cause in plain words, then what happened to the others.

        Once the gang's cancel is requested, a rank not yet over counts as cancelled: the failing
        rank's own message is built at the poll that saw the failure, before the siblings ended,
        and must tell the same story as theirs.
        """
        cause = self.root_cause()
        if cause is None:
            return ""
        if cause.state == LOST:
            head = f"rank {cause.rank} ({cause.ip}) was lost: {cause.reason}"
        elif cause.reason.startswith(HUNG_PREFIX):
            head = f"rank {cause.rank} ({cause.ip}) {cause.reason}"
        else:
            head = f"rank {cause.rank} ({cause.ip}) exited with code {cause.exit_code}"
            if cause.reason != f"exited with code {cause.exit_code}":
                head += f": {cause.reason}"
        states = {
            r.rank: CANCELLED if self.cancel_requested and not r.terminal else r.state for r in self.ranks
        }
        groups: dict[RankState, list[int]] = {}
        for r in self.ranks:
            if r.rank != cause.rank:
                groups.setdefault(states[r.rank], []).append(r.rank)
        tail = "; ".join(f"{ranks_text(v)} {k}" for k, v in sorted(groups.items()))
        codes = [
            "cancelled"
            if states[r.rank] == CANCELLED
            else "hung"
            if r.reason.startswith(HUNG_PREFIX)
            else r.exit_code
            for r in self.ranks
        ]
        msg = f"Job {self.job_id} failed: {head}"
        if tail:
            msg += f"; {tail}"
        return msg + f". {_codes_text(codes)}"

    def to_dict(self) -> dict[str, object]:
        return {
            "job_id": self.job_id,
            "cancel_requested": self.cancel_requested,
            "cancel_reason": self.cancel_reason,
            "ranks": [r.to_dict() for r in self.ranks],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> GangStatus:
        raw = data.get("ranks", [])
        if not isinstance(raw, list):
            raise TypeError(f"ranks: expected a list of rank dicts, got {type(raw).__name__}")
        ranks = [RankStatus(**r) for r in raw]  # each state read back as a RankState (__post_init__)
        return cls(
            str(data["job_id"]),
            ranks,
            bool(data.get("cancel_requested")),
            str(data.get("cancel_reason") or ""),
        )


def rank_runs(ranks: Iterable[int]) -> list[tuple[int, int]]:
    """The distinct ranks as runs of consecutive ones, ``(first, last)`` each, in order."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return [(a, b) for a, b in runs]


def ranks_text(ranks: Iterable[int]) -> str:
    """``ranks 0, 1, 3``; a run of three or more as ``4-1023`` (a 1,024-rank gang's story stays short)."""
    rs = sorted(ranks)
    parts: list[str] = []
    for a, b in rank_runs(rs):
        parts += [f"{a}-{b}"] if b - a >= 2 else [str(x) for x in range(a, b + 1)]
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(parts)


def job_id_for(dag_id: str, run_id: str, task_id: str, map_index: int | None, try_number: int) -> str:
    """A job id unique per DAG run, task, map index and attempt, safe as a path part on a node.

    A readable slug of the DAG and task plus a hash of all five parts: two runs (or two attempts)
    never share a job directory, so they can never touch each other's processes. ``map_index``
    None (how Airflow's task instance type allows an unmapped task to say so) is -1, unmapped.
    """
    import hashlib
    import re

    if map_index is None:
        map_index = -1

    digest = hashlib.sha256(f"{dag_id}\0{run_id}\0{task_id}\0{map_index}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^A-Za-z0-9_-]+", "-", f"{dag_id}.{task_id}").strip("-")[:60] or "job"
    mi = "" if map_index < 0 else f"-m{map_index}"
    return f"{slug}-{digest}{mi}-t{try_number}"


def cancel_reason(status: GangStatus) -> str:
    """What the siblings of a failed rank read as the reason of their cancel: the rank and why it
    failed, so a sibling's own log already says what went wrong ("rank 2 failed first: exited with
    code 1"), whichever watcher told it."""
    cause = status.root_cause()
    if cause is None:
        return "a rank failed"
    return (
        f"rank {cause.rank} failed first: {cause.reason}"
        if cause.reason
        else f"rank {cause.rank} failed first"
    )
