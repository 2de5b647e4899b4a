"""The control plane's side of the node agent: one call to start a gang, one per status poll, one to cancel.

The head's agent answers for the whole gang, so a poll costs one call at any number of nodes. What a
node runs is rendered here, from the node runtime (:mod:`airflow_provider_sky.node.runtime`): each node's
launch script and the cancel script travel in the start message, so the agent on the node carries no
copy of them and a rank's start, exit record and cancel are the same as on the per-node path.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.agent.node import Channel, ProtocolError, connect
from airflow_provider_sky.errors import AgentError as AgentError
from airflow_provider_sky.errors import AgentUnreachable as AgentUnreachable
from airflow_provider_sky.node import runtime
from airflow_provider_sky.node.shell import CANCEL_SCRIPT, DUMP_SCRIPT

log = logging.getLogger(__name__)

#: the states a rank ends in, as the agents report them
TERMINAL = ("exited", "badexit", "lost")


@dataclass(frozen=True)
class NodePlan:
    """What one node's agent runs to start its ranks: today's launch script for that node, its ranks as
    ``(root, rank)`` and the machine's gang flag (the agent writes a failure seen elsewhere there, so
    the node's launchers start nothing more)."""

    ranks: list[tuple[str, int]]
    script: str
    flag: str
    #: the script's positional arguments (``sh -s -- ARGS`` on the node): ids, integers and paths
    args: tuple[str, ...] = ()

    def to_msg(self) -> dict[str, Any]:
        return {
            "ranks": [[root, rank] for root, rank in self.ranks],
            "script": self.script,
            "args": list(self.args),
            "flag": self.flag,
        }


def node_plan(
    job_id: str,
    items: Sequence[tuple[str, runtime.RankLaunch, runtime.Guard]],
    grace: float = 3.0,
    wait_seconds: float = 20.0,
) -> NodePlan:
    """One node's plan from the same items :func:`runtime.launch_many_script` takes (its machine's gang
    flag under the first node root, as a gang start without the agent has it)."""
    if not items:
        raise ValueError("a node plan needs at least one rank")
    flag = runtime.gang_flag(items[0][0], job_id)
    script = runtime.launch_many_script(job_id, items, wait_seconds, flag=flag, grace=grace)
    return NodePlan([(root, int(rl.rank)) for root, rl, _ in items], script, flag)


@dataclass(frozen=True)
class AgentRank:
    """One rank as the head knows it (read on its node from the wrapper's records)."""

    rank: int
    node: str
    state: str  # pending | running | exited | badexit | lost
    exit_code: int | None = None
    start: float | None = None
    end: float | None = None
    #: the cancel reason that reached it, as the node wrote it (``@rank-failed 2 1``, free text)
    why: str = ""
    oom: bool = False
    orphaned: bool = False
    #: it failed on its own (what fails a gang), not by a cancel
    own: bool = False
    #: a watcher found it hung (its ``hang/`` directory)
    hung: bool = False
    #: its log's size as its node last said (heartbeats while it runs, its exit record's read at the
    #: end); None: not known yet
    log_size: int | None = None
    #: its progress file's mtime (node clock, whole seconds), None without one
    progress: float | None = None
    #: new log bytes from the offset the status call asked for, as ``(offset, bytes)``, from the head
    chunk: tuple[int, bytes] | None = None
    #: the end of the log bytes its agent shipped to the head; None: the head has none of its log
    shipped: int | None = None
    #: the head's window of its log starts past the asked offset: read that part from its node
    behind: bool = False

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def on_lost_node(self) -> bool:
        """Its own node was lost (the head heard nothing from its agent): the gang's failure itself, not
        a cancel that reached it (its ``why`` then says why the node was lost)."""
        return self.state == "lost" and self.why.startswith(f"node {self.node} lost:")

    @property
    def reason(self) -> str:
        """The cancel reason as users read it (``rank 2 failed first: exited with code 1``)."""
        return runtime.node_cancel_reason(self.why) if self.why and not self.on_lost_node else ""

    def to_raw(self, job_id: str) -> runtime.RawRankStatus:
        """The rank as the per-node status script reports it, for the gang policy (``gang.classify``):
        the same record read the same way, whichever path read it. No log bytes: logs stay on the
        per-rank path."""
        return runtime.RawRankStatus(
            job_id=job_id,
            rank=self.rank,
            state=self.state,
            exit_code=self.exit_code,
            start=self.start,
            end=self.end,
            log_size=self.log_size or 0,
            cancel_requested=bool(self.why) and not self.on_lost_node,
            log_offset=0,
            log_chunk=b"",
            orphaned=self.orphaned,
            # a lost node's rank: the head's word on why its node was lost (``its agent stopped
            # answering for 10s``), which the gang policy tells as the rank's reason
            cancel_reason=self.why.split(" lost: ", 1)[1] if self.on_lost_node else self.reason,
            oom=self.oom,
            hung=self.hung,
            progress=self.progress,
        )


@dataclass(frozen=True)
class AgentStatus:
    """The gang as its head sees it: the decision (``state``, ``reason``, ``cause``) and every rank."""

    job_id: str
    state: str  # running | succeeded | failed | cancelled
    reason: str
    cause: dict[str, Any] | None
    done: bool
    ranks: list[AgentRank]
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: when the head decided the gang's fate (failed, cancelled: the head's clock), None while it runs
    decided: float | None = None
    #: the agents ship running ranks' logs to the head (an older agent does not: read the nodes)
    ships: bool = False
    #: the head finds hung ranks itself after this many seconds of silence (0: it does not)
    hang_timeout: float = 0.0

    def by_rank(self, rank: int) -> AgentRank:
        return next(r for r in self.ranks if r.rank == rank)


@dataclass(frozen=True)
class StartResult:
    """Each node's launch output (``STARTED``/``EXISTS``/``CANCELLED`` lines, ``GANGFAILED``) and the
    gang's state when the last node answered."""

    state: str
    nodes: dict[str, dict[str, Any]]

    def words(self) -> dict[int, str]:
        """rank -> the first word its launcher printed about it (``STARTED``, ``CANCELLED``...)."""
        out: dict[int, str] = {}
        for res in self.nodes.values():
            for line in str(res.get("out") or "").splitlines():
                parts = line.split()
                if len(parts) >= 2 and parts[1].isdigit():
                    out.setdefault(int(parts[1]), parts[0])
        return out

    def errors(self) -> dict[str, str]:
        """node -> why its start failed (a nonzero script, no answer)."""
        return {
            node: str(res.get("error") or f"the launch script exited with {res.get('rc')}: {res.get('out')}")
            for node, res in self.nodes.items()
            if res.get("rc") != 0
        }


def _chunk(item: Any) -> tuple[int, bytes] | None:
    if not (
        isinstance(item, list) and len(item) == 2 and isinstance(item[0], int) and isinstance(item[1], str)
    ):
        return None
    try:
        return item[0], base64.b64decode(item[1], validate=True)
    except (binascii.Error, ValueError):
        return None


def _rank(rec: Mapping[str, Any]) -> AgentRank:
    code = rec.get("code")
    return AgentRank(
        rank=int(rec["rank"]),
        node=str(rec.get("node", "")),
        state=str(rec.get("state", "pending")),
        exit_code=int(code) if isinstance(code, int) else None,
        start=rec.get("start"),
        end=rec.get("end"),
        why=str(rec.get("why") or ""),
        oom=bool(rec.get("oom")),
        orphaned=bool(rec.get("orphaned")),
        own=bool(rec.get("own")),
        hung=bool(rec.get("hung")),
        log_size=int(rec["log"]) if isinstance(rec.get("log"), int) else None,
        progress=float(rec["progress"]) if isinstance(rec.get("progress"), (int, float)) else None,
        chunk=_chunk(rec.get("chunk")),
        shipped=int(rec["shipped"]) if isinstance(rec.get("shipped"), int) else None,
        behind=bool(rec.get("behind")),
    )


class AgentClient:
    """A connection to a cluster's head agent (kept open between calls; made again when it broke).

    ``token``: the cluster's token (bytes, never logged). Every call is one request and its answer."""

    def __init__(self, host: str, port: int, token: bytes, timeout: float = 5.0) -> None:
        self.host, self.port = host, int(port)
        self._token = token
        self.timeout = timeout
        self._chan: Channel | None = None
        self._lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)

    def __repr__(self) -> str:  # no token in any repr or log line
        return f"AgentClient({self.host}:{self.port})"

    async def _connect(self) -> Channel:
        if self._chan is None:
            try:
                self._chan = await connect(
                    self.host, self.port, self._token, {"op": "hello", "role": "control"}, self.timeout
                )
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
                raise AgentUnreachable(
                    f"the head agent at {self.host}:{self.port} did not answer: {exc!r}"
                ) from exc
            except ProtocolError as exc:
                raise AgentError(f"the head agent at {self.host}:{self.port}: {exc}") from exc
        return self._chan

    async def call(
        self, op: str, wait: float | None = None, retry: bool = True, **args: Any
    ) -> dict[str, Any]:
        """One request, one answer. A connection found broken is made again once (``retry``: only for
        calls that may be sent twice)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            # a sync caller runs each call on a loop of its own: a connection (and the lock) belong
            # to the loop that made them
            if self._chan is not None:
                try:
                    self._chan.close()
                except RuntimeError:  # its loop is closed: the socket goes with the transport
                    pass
            self._chan, self._lock, self._loop = None, asyncio.Lock(), loop
        async with self._lock:
            for attempt in (0, 1):
                chan = await self._connect()
                rid = next(self._ids)
                try:
                    await chan.send({"op": op, "id": rid, **args}, timeout=self.timeout)
                    while True:
                        reply = await chan.recv(wait or self.timeout)
                        if reply.get("id") == rid:
                            break
                except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ProtocolError) as exc:
                    chan.close()
                    self._chan = None
                    if attempt == 0 and retry and not isinstance(exc, asyncio.TimeoutError):
                        continue
                    raise AgentUnreachable(
                        f"the head agent at {self.host}:{self.port}: {op} failed: {exc!r}"
                    ) from exc
                if not reply.get("ok"):
                    if reply.get("error") == "unreachable":
                        nodes = [str(n) for n in reply.get("nodes") or []]
                        raise AgentUnreachable(f"the head does not reach nodes {', '.join(nodes)}", nodes)
                    raise AgentError(f"{op}: {reply.get('error')}")
                return reply
        raise AssertionError("unreachable")

    async def start(
        self,
        job_id: str,
        plan: Mapping[str, NodePlan],
        *,
        grace: float = 3.0,
        orphan_timeout: float = 0.0,
        hang_timeout: float = 0.0,
        lost_after: float = 0.0,
        attempt_of: str = "",
        timeout: float = 120.0,
    ) -> StartResult:
        """Start the gang: one call; the head has every node's agent run its launch script. Raises
        :class:`AgentUnreachable` (nothing started) when a node's agent is not connected to the head.

        ``hang_timeout``: the head dumps and fails ranks silent that long. ``lost_after``: a node not
        heard from that long is lost, and a node that did not hear from the head that long stops the
        job's ranks (0: the agents' own). ``attempt_of``: this is a later attempt of that job (whole-gang
        retries): the head gives it that job's dead-man's switch, hang watch and ``lost_after``."""
        runtime.check_job_id(job_id)
        args: dict[str, Any] = {}
        if hang_timeout > 0:
            args.update(hang_timeout=float(hang_timeout), dump_script=DUMP_SCRIPT)
        if lost_after > 0:
            args["lost_after"] = float(lost_after)
        if attempt_of:
            args["attempt_of"] = runtime.check_job_id(attempt_of)
        reply = await self.call(
            "start",
            wait=timeout + self.timeout,
            retry=False,
            job=job_id,
            nodes={node: p.to_msg() for node, p in plan.items()},
            cancel_script=CANCEL_SCRIPT,
            grace=float(grace),
            orphan_timeout=float(orphan_timeout),
            timeout=float(timeout),
            **args,
        )
        return StartResult(state=str(reply.get("state")), nodes=dict(reply.get("nodes") or {}))

    async def status(
        self,
        job_id: str,
        touch: bool = True,
        logs_from: Mapping[int, int] | None = None,
        max_log: int = 0,
    ) -> AgentStatus:
        """Every rank of the gang and the head's decision: one call at any number of nodes. ``touch``
        False: a look that does not count as a watcher's poll for the head's dead-man's switch.
        ``logs_from`` (rank -> offset) with ``max_log``: also each rank's new log bytes the head holds."""
        args: dict[str, Any] = {} if touch else {"peek": True}
        if logs_from and max_log > 0:
            args.update(logs_from={str(r): int(off) for r, off in logs_from.items()}, max_log=int(max_log))
        reply = await self.call("status", job=job_id, **args)
        cause = reply.get("cause")
        return AgentStatus(
            job_id=job_id,
            state=str(reply["state"]),
            reason=runtime.node_cancel_reason(str(reply.get("reason") or "")),
            cause=cause if isinstance(cause, dict) else None,
            done=bool(reply.get("done")),
            ranks=[_rank(r) for r in reply.get("ranks") or []],
            nodes=dict(reply.get("nodes") or {}),
            decided=reply.get("decided"),
            ships=reply.get("ships") is True,
            hang_timeout=float(reply["hang"]) if isinstance(reply.get("hang"), (int, float)) else 0.0,
        )

    async def cancel(self, job_id: str, reason: str = "cancelled") -> str:
        """Cancel the gang: one call; the head tells every agent at once. Returns the gang's state
        (a gang that failed first stays ``failed``)."""
        reply = await self.call("cancel", job=job_id, reason=" ".join(reason.split())[:400])
        return str(reply.get("state"))

    async def nodes(self) -> dict[str, dict[str, Any]]:
        """The agents the head hears from: node -> ``up``, seconds since last ``heard``."""
        return dict((await self.call("nodes")).get("nodes") or {})

    def close(self) -> None:
        """Close the connection (sync: a closed transport needs no await)."""
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    async def aclose(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None
