"""Start, watch, read and cancel one gang job through a backend's runners (no Airflow here).

One rank per node: rank ``i`` runs on ``handle.nodes[i]``. Every operation is one remote call per
node, fanned out in parallel with a bound.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass, field
from typing import TypeVar

from airflow_provider_sky.agent.client import (
    AgentClient,
    AgentError,
    AgentStatus,
    AgentUnreachable,
    NodePlan,
    node_plan,
)
from airflow_provider_sky.aio import CANCEL_WAIT, FANOUT_LIMIT, cancel_bounded, fan_out, run_sync
from airflow_provider_sky.backends.base import Backend, ClusterHandle, Node, chosen_resources, node_devices
from airflow_provider_sky.errors import LaunchError as LaunchError
from airflow_provider_sky.model.gang import (
    UNKNOWN,
    GangStatus,
    RankStatus,
    cancel_reason,
    classify,
    cluster_info_json,
    gpus_per_node,
    rank_runs,
    run_env,
    setup_env,
)
from airflow_provider_sky.model.logtext import READ_CHUNK
from airflow_provider_sky.node import runtime
from airflow_provider_sky.runners.base import CommandRunner, RunnerError
from airflow_provider_sky.spec import TaskSpec

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
DEFAULT_LOG_CHUNK = 256 * 1024
#: how often a gang start looks at the ranks it already started (a failure there stops the start)
LAUNCH_WATCH_INTERVAL = 0.2
#: seconds without any poll after which the nodes kill a job (a lost scheduler, a killed ``dags test``)
DEFAULT_ORPHAN_TIMEOUT = 300.0
#: a head agent that did not answer is not asked again for this long (the per-node path meanwhile)
AGENT_RETRY_AFTER = 30.0


#: ranks one status or cancel call covers at most: its arguments (a root, a job id of up to 181
#: characters) must fit one command line, and its answer holds up to a log chunk per rank
CALL_RANKS = 256
#: ranks one gang-start call starts (its script carries every rank's env: ~15 KB each at 1,024 nodes)
LAUNCH_RANKS = 32
#: argument bytes of one call at most: an SSH command line is one string, which Linux caps at 128 KiB
CALL_ARG_BYTES = 64 * 1024


def _span(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 7]`` as ``0-2,7``: how log lines and errors name the ranks of one call."""
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in rank_runs(ranks))


def _launch_words(text: str) -> dict[int, str]:
    """``STARTED <rank> <pid>`` / ``EXISTS <rank>`` / ``CANCELLED <rank>`` lines: rank -> word (the
    first said: a rank that existed already is also waited for, and then reads ``STARTED``)."""
    out: dict[int, str] = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) >= 2 and words[1].isdigit():
            out.setdefault(int(words[1]), words[0])
    return out


def _gang_failed(text: str) -> tuple[int, int | None] | None:
    """The rank and exit code of a launcher's ``GANGFAILED rank=R code=C`` line, if it printed one."""
    for line in text.splitlines():
        if line.startswith("GANGFAILED rank="):
            words = dict(w.partition("=")[::2] for w in line.split()[1:])
            rank, code = words.get("rank", ""), words.get("code", "")
            if rank.isdigit():
                return int(rank), int(code) if code.lstrip("-").isdigit() else None
    return None


@dataclass
class Poll:
    """One poll of a job: every rank's status plus the log bytes that appeared since the last poll."""

    status: GangStatus
    chunks: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    unreachable: dict[int, str] = field(default_factory=dict)
    at: float = 0.0
    #: ranks whose node holds a cancel for them (it reached them; they may still be ending)
    cancel_seen: set[int] = field(default_factory=set)
    #: the cluster's head agent finds this job's hung ranks after this many seconds (0: the watchers do)
    head_hangs: float = 0.0


class GangClient:
    """Operations on one job of one cluster; holds a runner per node (connections stay open)."""

    def __init__(self, backend: Backend, handle: ClusterHandle) -> None:
        self.backend = backend
        backend.check_handle(handle)
        self.handle = handle
        self._runners: dict[str, CommandRunner] = {}
        #: values to mask when showing this job's logs (filled by whoever reads them)
        self.secret_values: list[str] = []
        #: how long one poll waits for a node before counting it unreachable for that round
        self.status_timeout = 5.0
        #: keep the run's secrets on the nodes (0600) until the job is over: a gang with retries
        #: starts its later attempts from the nodes' files (``runtime_retry``)
        self.keep_secrets = False
        #: the cluster's head agent (``docs/node-agent.md``), when it runs them: start, status and
        #: cancel are then one call each; None until asked, or when the cluster has none
        self._agent: AgentClient | None = None
        self._agent_asked = False
        self._agent_off_until = 0.0
        #: jobs the head does not know (started the per-node way): read the per-node way
        self._per_node_jobs: set[str] = set()
        #: jobs this client started through the head agent: their fate is decided on the nodes
        self.agent_jobs: set[str] = set()
        #: calls made to the head agent, and per-node status calls (counted for the benchmarks)
        self.agent_calls = 0
        self.node_calls = 0

    def runner(self, node: Node) -> CommandRunner:
        if node.node_id not in self._runners:
            self._runners[node.node_id] = self.backend.runner(node)
        return self._runners[node.node_id]

    def close(self) -> None:
        for r in self._runners.values():
            r.close()
        self._runners.clear()
        if self._agent is not None:
            self._agent.close()
            self._agent = None
            self._agent_asked = False

    # -- the node agents ------------------------------------------------------------------------

    async def agent(self) -> AgentClient | None:
        """The head agent's client, when the cluster runs agents and the head answered lately."""
        if time.monotonic() < self._agent_off_until:
            return None
        if not self._agent_asked:
            self._agent_asked = True
            if type(self.backend).agent_endpoint is Backend.agent_endpoint:
                return None  # a backend without agents: no thread hop per client
            try:
                found = await asyncio.to_thread(self.backend.agent_endpoint, self.handle)
            except Exception as exc:  # the per-node path is always there
                log.info("The node agent of cluster %s cannot be used: %s", self.handle.name, exc)
                found = None
            if found is not None:
                self._agent = AgentClient(*found, timeout=self.status_timeout)
        return self._agent

    def has_agent(self) -> bool:
        """Whether the cluster's head agent can take this client's calls (sync; one look at the
        cluster the first time, e.g. a read of its token)."""
        return run_sync(self._once(self.agent())) is not None

    def _agent_down(self, exc: Exception) -> None:
        """The head agent did not answer: the per-node path for :data:`AGENT_RETRY_AFTER`, then the
        endpoint (and token) are asked afresh."""
        log.warning(
            "The head agent of cluster %s did not answer (%s): using the per-node path for %.0fs",
            self.handle.name,
            exc,
            AGENT_RETRY_AFTER,
        )
        self._agent_off_until = time.monotonic() + AGENT_RETRY_AFTER
        if self._agent is not None:
            self._agent.close()
        self._agent, self._agent_asked = None, False
        try:
            self.backend.forget_agent(self.handle)
        except Exception:  # a courtesy: the next ask reads the endpoint again anyway
            log.debug("forget_agent failed", exc_info=True)

    async def _once(self, coro: Awaitable[T]) -> T:
        """A sync call's coroutine (its own event loop): the head agent's connection, which belongs
        to that loop, is closed with it."""
        try:
            return await coro
        finally:
            if self._agent is not None:
                await self._agent.aclose()

    async def _agent_launch(
        self,
        agent: AgentClient,
        spec: TaskSpec,
        job_id: str,
        stage: str,
        orphan_timeout: float,
        idle_down: float,
        grace: float,
        hang_timeout: float = 0.0,
        lost_after: float = 0.0,
    ) -> dict[int, str]:
        """The gang start through the head: one call; every node's agent runs that node's launch
        script (the one the per-node path runs). The dead-man's switch and the hang watch move to the
        head (nothing marks the nodes' poll files on this path). Raises :class:`AgentUnreachable`
        (nothing started)."""
        launches = self.rank_launches(spec, job_id, stage)
        by_node: dict[str, list[tuple[str, runtime.RankLaunch, runtime.Guard]]] = {}
        for rl in launches:
            node = self.node_of(rl.rank)
            by_node.setdefault(node.node_id, []).append((node.root, rl, self.guard(rl.rank, 0, idle_down)))
        plan = {nid: node_plan(job_id, items, grace) for nid, items in by_node.items()}
        self.agent_calls += 1
        res = await agent.start(
            job_id,
            plan,
            grace=grace,
            orphan_timeout=orphan_timeout,
            hang_timeout=hang_timeout,
            lost_after=lost_after,
            timeout=60 + len(launches) / 8,
        )
        errors = res.errors()
        words = res.words()
        missing = [r for r in range(self.num_ranks) if words.get(r) not in ("STARTED", "EXISTS", "CANCELLED")]
        if errors or missing:
            await self.acancel(job_id, grace=1.0, reason="the gang start failed")
            why = [f"node {n}: launch failed: {e}" for n, e in errors.items()]
            if missing and not errors:
                why.append(f"the rank wrapper of ranks {_span(missing)} did not start")
            raise LaunchError("; ".join(why))
        if res.state == "failed":
            log.info("A rank of job %s failed during the gang start (the head cancelled the gang)", job_id)
        self.agent_jobs.add(job_id)
        return words

    async def agent_restart(
        self,
        job_id: str,
        aid: str,
        script: str,
        args_of: Callable[[str, list[int]], list[str]],
        grace: float,
    ) -> list[str | BaseException] | None:
        """Start ``aid``, a later attempt of ``job_id`` (whole-gang retries), through the head that runs
        ``job_id``: one call, each node's agent runs ``script`` with ``args_of(its gang flag, its
        ranks)``; the head then decides the attempt's fate as the first's (its dead-man's switch and hang
        watch too). Returns each node's output (or its error), or None: not this way (no agent, the head
        does not know ``job_id``, or it did not take the start): the caller runs it per node."""
        if job_id in self._per_node_jobs:
            return None
        agent = await self.agent()
        if agent is None:
            return None
        by_node: dict[str, list[int]] = {}
        for r in range(self.num_ranks):
            by_node.setdefault(self.node_of(r).node_id, []).append(r)
        plan = {}
        for nid, ranks in by_node.items():
            flag = runtime.gang_flag(self.node_of(ranks[0]).root, aid) if self.num_ranks > 1 else ""
            targets = [(self.node_of(r).root, r) for r in ranks]
            plan[nid] = NodePlan(targets, script, flag, tuple(args_of(flag, ranks)))
        self.agent_calls += 1
        try:
            res = await agent.start(
                aid, plan, grace=grace, attempt_of=job_id, timeout=60 + self.num_ranks / 8
            )
        except AgentUnreachable as exc:  # nothing started: the per-node path
            self._agent_down(exc)
            return None
        except AgentError as exc:  # the head does not know job_id, or another watcher started it
            log.info("The head did not start %s (%s): the per-node path", aid, exc)
            return None
        self._per_node_jobs.discard(aid)  # a look before the start found no such job on the head
        self.agent_jobs.add(aid)
        errors = res.errors()
        return [
            RunnerError(nid, errors[nid]) if nid in errors else str(out.get("out") or "")
            for nid, out in res.nodes.items()
        ]

    async def _agent_status(
        self,
        job_id: str,
        mark: bool = True,
        logs_from: Mapping[int, int] | None = None,
        max_log: int = 0,
    ) -> AgentStatus | None:
        """The gang's status from its head (one call; with ``logs_from``, the new log bytes the head
        holds too), or None: no agent, or the head does not know this job (then the per-node path
        reads it, from now on)."""
        if job_id in self._per_node_jobs:
            return None
        agent = await self.agent()
        if agent is None:
            return None
        self.agent_calls += 1
        try:
            return await agent.status(job_id, touch=mark, logs_from=logs_from, max_log=max_log)
        except AgentUnreachable as exc:
            self._agent_down(exc)
        except AgentError as exc:
            log.info("Job %s is read the per-node way: %s", job_id, exc)
            self._per_node_jobs.add(job_id)
        return None

    @property
    def num_ranks(self) -> int:
        return len(self.handle.nodes)

    def node_of(self, rank: int) -> Node:
        return self.handle.nodes[rank]

    # -- launch ---------------------------------------------------------------------------------

    def rank_launches(self, spec: TaskSpec, job_id: str, stage: str) -> list[runtime.RankLaunch]:
        """The command and env of every rank for the ``run`` or ``setup`` stage."""
        h = self.handle
        info = cluster_info_json(h.name, h.cloud, h.region, h.zone)
        ips = h.ips
        # the alternative the cluster was provisioned with; its GPU count is what SkyPilot exports
        acc = chosen_resources(spec, h).accelerators
        # none asked: the GPUs of the node's machine type, when its backend chose one (EC2's instance type)
        gpus = gpus_per_node(acc.count) if acc else int(h.extra.get("node_gpus") or 0)
        out = []
        for rank, node in enumerate(h.nodes):
            devices = node_devices(node, acc)
            if stage == "setup":
                env = setup_env(
                    rank=rank,
                    ips=ips,
                    task_id=job_id,
                    cluster_info=info,
                    user_envs=spec.envs,
                    gpus_per_node=gpus,
                    devices=devices,
                )
                command = spec.setup or "true"
            else:
                env = run_env(
                    rank=rank,
                    ips=ips,
                    task_id=job_id,
                    cluster_info=info,
                    gpus_per_node=gpus,
                    user_envs=spec.envs,
                    devices=devices,
                )
                command = spec.run
            if self.backend.shared_machine and node.home:
                # nodes sharing a machine are started in batches through one node's runner: each rank
                # still gets its own node's home (a user's envs may set HOME themselves)
                env = {"HOME": node.home, **env}
            cwd = self.backend.workdir(node, spec)
            keep = self.keep_secrets and stage == "run"
            result_file = spec.result_file if stage == "run" else None
            out.append(
                runtime.RankLaunch(
                    rank, command, env, dict(spec.secrets), cwd, keep_secrets=keep, result_file=result_file
                )
            )
        return out

    def guard(self, rank: int, orphan_timeout: float, idle_down: float) -> runtime.Guard:
        """The node-side guards of one rank's launch: one keeper per machine, armed with our clock."""
        roots: list[str] | None = None
        if self.backend.shared_machine:  # every node on one machine: one keeper
            roots = [n.root for n in self.handle.nodes] if rank == 0 else []
        return runtime.Guard(
            orphan_timeout=int(math.ceil(orphan_timeout)) if orphan_timeout else 0,
            idle_down=int(math.ceil(idle_down)) if idle_down else 0,
            idle_rm=tuple(self.backend.idle_down_paths(self.handle, rank)) if idle_down else (),
            idle_kill=self.backend.idle_down_kill,
            idle_poweroff=self.backend.idle_down_poweroff if idle_down else "",
            keeper_roots=roots,
            keeper_tick=max(0.2, min(5.0, min(t for t in (orphan_timeout, idle_down, 50.0) if t) / 10)),
            now=time.time(),
        )

    async def alaunch(
        self,
        spec: TaskSpec,
        job_id: str,
        stage: str = "run",
        *,
        orphan_timeout: float = DEFAULT_ORPHAN_TIMEOUT,
        idle_down: float = 0,
        grace: float = 3.0,
        hang_timeout: float = 0.0,
        lost_after: float = 0.0,
    ) -> dict[int, str]:
        """Start every rank at once. Returns rank → ``STARTED``/``EXISTS``/``CANCELLED``.

        A gang start over many nodes takes a while (seconds at 64 SSH hosts), so it is watched while
        it runs: once a started rank has failed, the started ones are cancelled (SIGKILL after
        ``grace``) and the rest are not started but recorded ``CANCELLED``; the job then reads as
        failed, root cause included. A launch that fails cancels every rank and raises
        :class:`LaunchError`. ``orphan_timeout``: the nodes kill the job when nothing polled it for
        that long (0: never). ``idle_down``: the nodes tear the cluster down once nothing ran on it
        for that long (0: never). ``hang_timeout``, ``lost_after``: on a cluster with node agents the
        head finds hung ranks and lost nodes by them (elsewhere the watchers do).
        """
        runtime.check_job_id(job_id)
        agent = await self.agent()
        if agent is not None:
            try:
                return await self._agent_launch(
                    agent, spec, job_id, stage, orphan_timeout, idle_down, grace, hang_timeout, lost_after
                )
            except AgentUnreachable as exc:  # the launch scripts are idempotent: ranks started say EXISTS
                self._agent_down(exc)
            except AgentError as exc:
                log.warning("The head agent refused the start of job %s (%s): the per-node path", job_id, exc)
            self._per_node_jobs.add(job_id)
        launches = self.rank_launches(spec, job_id, stage)
        by_rank = {rl.rank: rl for rl in launches}
        chunks = self._calls(job_id, list(by_rank), LAUNCH_RANKS)
        flags = self._gang_flags(job_id) if len(launches) > 1 else {}
        started: list[int] = []
        failed: list[str] = []  # the cancel reason, once a started rank has failed
        cancelled: set[int] = set()  # started ranks already sent the cancel
        halted: list[int] = []  # ranks a launcher recorded cancelled unstarted: a rank of its machine failed
        inflight: dict[int, list[int]] = {}  # start calls sent and not answered yet, by their first rank

        async def fail(reason: str, rank: int, code: int | None) -> None:
            """The first failure seen: cancel the ranks started, and stop the start calls still running
            (their machine's flag stops their launchers, which then cancel what they started)."""
            if failed:
                return
            failed.append(reason)
            late = [r for r in started if r not in cancelled]
            cancelled.update(late)
            calls = (
                [self.acancel(job_id, late, grace, wait=False, reason=reason, fail_fast=True)] if late else []
            )
            calls += [
                self._halt_start(job_id, chunk, flags, rank, code, grace, reason)
                for chunk in inflight.values()
            ]
            await asyncio.gather(*calls, return_exceptions=True)

        async def one(chunk: list[int]) -> list[str]:
            """Start (or, after a sibling failed, record as cancelled) the ranks of one call."""
            node = self.node_of(chunk[0])
            where = f"ranks {_span(chunk)} ({', '.join(dict.fromkeys(self.node_of(r).ip for r in chunk))})"
            await self.runner(node).aconnect()  # the handshake first: start or skip decided after it
            if failed:
                words = await self._record_never_started(job_id, chunk, failed[0], by_rank)
                return [words[r] for r in chunk]
            items = [
                (self.node_of(r).root, by_rank[r], self.guard(r, orphan_timeout, idle_down)) for r in chunk
            ]
            flag = flags.get(self.backend.machine_of(node))
            script = runtime.launch_many_script(job_id, items, flag=flag, grace=grace)
            inflight[chunk[0]] = chunk
            try:
                res = await self.runner(node).arun_script(script, timeout=60 + len(chunk))
            finally:
                inflight.pop(chunk[0], None)
            if res.returncode != 0:
                raise LaunchError(f"{where}: launch failed: {res.error_text}")
            words = _launch_words(res.text)
            missing = [r for r in chunk if words.get(r) not in ("STARTED", "EXISTS", "CANCELLED")]
            if missing:
                raise LaunchError(f"{where}: the rank wrapper of ranks {_span(missing)} did not start")
            gang = _gang_failed(res.text)
            halted.extend(r for r in chunk if words[r] == "CANCELLED")
            mine = [r for r in chunk if words[r] != "CANCELLED"]
            started.extend(mine)
            if gang is not None:  # its launcher saw a rank of the machine fail, and cancelled its ranks
                cancelled.update(mine)
                await fail(runtime.failed_first(*gang), *gang)
            elif failed:  # they were on their way when a sibling failed: cancel them at once
                cancelled.update(mine)
                await self.acancel(job_id, mine, grace, wait=False, reason=failed[0], fail_fast=True)
            return [words[r] for r in chunk]

        async def watch_start() -> None:
            """Watch the started ranks until one failed (or another path saw a failure first): the
            machines' gang flags each interval, the ranks' status once a flag is set."""
            while not failed:
                await asyncio.sleep(LAUNCH_WATCH_INTERVAL)
                if failed:
                    break
                if not started or not await self._any_flag_set(flags, started):
                    continue
                status = (await self.apoll(job_id, max_log=0, ranks=list(started), mark=False)).status
                cause = status.root_cause()
                if cause is not None:
                    await fail(cancel_reason(status), cause.rank, cause.exit_code)

        watcher = asyncio.ensure_future(watch_start()) if len(launches) > 1 else None
        try:
            results = await fan_out(one, chunks, self.call_limit)
        finally:
            if watcher is not None:
                await cancel_bounded([watcher])
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.acancel(job_id, grace=1.0, reason="the gang start failed")
            raise LaunchError("; ".join(str(e) for e in errors))
        out = {
            r: word
            for chunk, words in zip(chunks, results, strict=True)
            if not isinstance(words, BaseException)
            for r, word in zip(chunk, words, strict=True)
        }
        if halted and not failed:
            failed.append("a rank failed during the gang start")
        if failed:
            # ranks started after the failing poll's snapshot, or before a launcher saw the failure (their
            # machine's launcher cancelled them already; a second cancel of a rank changes nothing)
            late = sorted(set(started) - cancelled)
            if late:
                await self.acancel(job_id, late, grace, wait=False, reason=failed[0], fail_fast=True)
            log.info("A rank of job %s failed during the gang start: %s", job_id, failed[0])
        return out

    async def _any_flag_set(self, flags: Mapping[str, str], ranks: Sequence[int]) -> bool:
        """Whether the gang flag (:func:`runtime.gang_flag`) of a machine of ``ranks`` says a rank there
        failed: one small read per machine. Every rank started with a flag that fails on its own writes
        it, so the start need not poll every started rank's status each interval: 1,024 local ranks cost
        half a CPU second a poll, five polls a second, while the same CPUs were starting the rest. A
        machine that does not answer counts as set (its ranks' status is read instead)."""
        nodes: dict[str, Node] = {}
        for rank in ranks:
            node = self.node_of(rank)
            nodes.setdefault(self.backend.machine_of(node), node)

        async def one(machine: str) -> bool:
            res = await self.runner(nodes[machine]).arun_script(
                runtime.FLAG_SET_SCRIPT, [flags[machine]], timeout=30
            )
            return res.returncode != 0 or res.text.strip() != "CLEAR"

        results = await fan_out(one, [m for m in nodes if m in flags], self.call_limit)
        return any(r is True or isinstance(r, BaseException) for r in results)

    def _gang_flags(self, job_id: str) -> dict[str, str]:
        """Machine -> its gang-start flag (:func:`runtime.gang_flag`, under its first node's root)."""
        out: dict[str, str] = {}
        for node in self.handle.nodes:
            out.setdefault(self.backend.machine_of(node), runtime.gang_flag(node.root, job_id))
        return out

    async def _halt_start(
        self,
        job_id: str,
        chunk: Sequence[int],
        flags: Mapping[str, str],
        rank: int,
        code: int | None,
        grace: float,
        reason: str,
    ) -> None:
        """A start call still running when a rank failed elsewhere: the failure goes into its machine's
        flag first (its launcher starts no more ranks, records them cancelled, and cancels what it
        started when it ends), then the ranks it started already are cancelled, in one call on a
        channel of its own. Without it those ranks ran until the call answered (64 SSH hosts: 1.2 s)."""
        node = self.node_of(chunk[0])
        flag = flags.get(self.backend.machine_of(node))
        script = (runtime.flag_failure(flag, rank, code) if flag else "") + runtime.CANCEL_SCRIPT
        targets = [(self.node_of(r).root, job_id, r) for r in chunk]
        args = runtime.cancel_args(grace, targets, wait=False, reason=reason)
        try:
            res = await self.runner(node).arun_script(script, args, timeout=grace + 30)
        except RunnerError as exc:
            log.warning("Could not stop the start of ranks %s: %s", _span(chunk), exc)
            return
        if res.returncode != 0:
            log.warning("Could not stop the start of ranks %s: %s", _span(chunk), res.error_text)

    async def _record_never_started(
        self,
        job_id: str,
        ranks: Sequence[int],
        reason: str,
        launches: Mapping[int, runtime.RankLaunch] | None = None,
    ) -> dict[int, str]:
        """Record ``ranks`` as cancelled without having run (``reason`` says why): one call per machine
        (per :data:`CALL_RANKS`). Rank -> ``CANCELLED``, or ``EXISTS`` for one started meanwhile.

        ``launches``: the ranks' launches; those whose later attempts start from the nodes' files
        (``keep_secrets``) are written there as a start would, so a retry starts them too."""

        async def one(chunk: list[int]) -> dict[int, str]:
            node = self.node_of(chunk[0])
            if launches is not None and any(launches[r].keep_secrets for r in chunk):
                items = [(self.node_of(r).root, launches[r], self.guard(r, 0, 0)) for r in chunk]
                script = runtime.launch_many_script(job_id, items, halt=reason)
                res = await self.runner(node).arun_script(script, timeout=60 + len(chunk))
            else:
                args = [job_id, reason]
                for r in chunk:
                    args += [self.node_of(r).root, str(r)]
                res = await self.runner(node).arun_script(runtime.NEVER_STARTED_SCRIPT, args, timeout=60)
            if res.returncode != 0:
                raise LaunchError(
                    f"ranks {_span(chunk)} ({node.ip}): could not record them: {res.error_text}"
                )
            words = _launch_words(res.text)
            return {r: words.get(r, "CANCELLED") for r in chunk}

        calls = self._calls(job_id, ranks)
        out: dict[int, str] = {}
        for res in await fan_out(one, calls, self.call_limit):
            if isinstance(res, BaseException):
                raise res
            out.update(res)
        return out

    def launch(self, spec: TaskSpec, job_id: str, stage: str = "run", **guards: float) -> dict[int, str]:
        return run_sync(self._once(self.alaunch(spec, job_id, stage, **guards)))

    # -- status ---------------------------------------------------------------------------------

    async def apoll(
        self,
        job_id: str,
        offsets: Mapping[int, int] | None = None,
        max_log: int = DEFAULT_LOG_CHUNK,
        ranks: Sequence[int] | None = None,
        *,
        mark: bool = True,
    ) -> Poll:
        """One status call per machine (per :data:`CALL_RANKS` ranks of it): states of its ranks plus
        new log bytes from ``offsets``. The calls run in parallel, each bounded by ``status_timeout``.

        ``mark`` leaves this poll's time on the nodes, which keeps their dead-man's switch from
        firing; a poll that must not keep a job alive (the launch-side bridge) passes False. A call
        that fails makes just its ranks unreachable; a rank missing from an answer is an error for
        that rank.
        """
        offsets = offsets or {}
        wanted = list(range(self.num_ranks)) if ranks is None else list(ranks)
        started = time.time()
        found = await self._agent_status(
            job_id, mark, {r: offsets.get(r, 0) for r in wanted} if max_log > 0 else None, max_log
        )
        if found is not None:
            return await self._agent_poll(found, job_id, offsets, max_log, wanted, started)
        calls = self._calls(job_id, wanted)

        async def one(chunk: list[int]) -> dict[int, runtime.RawRankStatus | RunnerError]:
            return await self._status_many(job_id, chunk, offsets, max_log, mark=mark)

        self.node_calls += len(calls)
        results = await self._bounded(one, calls)
        now = started  # a node that answers late is judged from when we asked
        by_rank: dict[int, runtime.RawRankStatus | BaseException] = {}
        for chunk, res in zip(calls, results, strict=True):
            for rank in chunk:
                by_rank[rank] = self._rank_error(rank, res) if isinstance(res, BaseException) else res[rank]
        poll = Poll(GangStatus(job_id), at=now)
        for rank in wanted:
            ip = self.node_of(rank).ip
            raw = by_rank[rank]
            if isinstance(raw, BaseException):
                poll.unreachable[rank] = str(raw)
                poll.status.ranks.append(RankStatus(rank, ip, UNKNOWN, reason=str(raw)))
                continue
            poll.status.ranks.append(classify(raw, ip, now))
            poll.status.cancel_requested |= raw.cancel_requested
            if raw.cancel_requested:
                poll.cancel_seen.add(rank)
            if raw.cancel_reason and not poll.status.cancel_reason:
                poll.status.cancel_reason = raw.cancel_reason
            if raw.log_chunk:
                poll.chunks[rank] = (raw.log_offset, raw.log_chunk)
        return poll

    async def _agent_poll(
        self,
        found: AgentStatus,
        job_id: str,
        offsets: Mapping[int, int],
        max_log: int,
        wanted: list[int],
        at: float,
    ) -> Poll:
        """A poll from the head's answer: every rank's state read the way the status script's is read
        (``AgentRank.to_raw``, ``classify``). Log bytes of a running rank come in the same answer
        (its agent ships them to the head each heartbeat); its node is read (one call per machine of
        such ranks) only where the head's window starts past the watcher's offset (a rank that printed
        faster than its agent ships), for a rank that ended (its last bytes) and where the agents do not
        ship (an older agent)."""
        poll = Poll(GangStatus(job_id), at=at, head_hangs=found.hang_timeout)
        by_rank = {r.rank: r for r in found.ranks}
        grown: list[int] = []
        for rank in wanted:
            ip = self.node_of(rank).ip
            ar = by_rank.get(rank)
            if ar is None:
                poll.status.ranks.append(RankStatus(rank, ip, UNKNOWN, reason="not in the head's answer"))
                poll.unreachable[rank] = "not in the head's answer"
                continue
            raw = ar.to_raw(job_id)
            poll.status.ranks.append(classify(raw, ip, at))
            poll.status.cancel_requested |= raw.cancel_requested
            if raw.cancel_requested:
                poll.cancel_seen.add(rank)
            if raw.cancel_reason and not poll.status.cancel_reason:
                poll.status.cancel_reason = raw.cancel_reason
            if max_log <= 0 or (ar.log_size or 0) <= offsets.get(rank, 0):
                continue
            if found.ships and not ar.terminal:
                if ar.chunk is not None and ar.chunk[1]:
                    poll.chunks[rank] = ar.chunk
                elif ar.behind:
                    grown.append(rank)
                continue  # the rest of its bytes: shipped to the head by the next heartbeat
            grown.append(rank)
        if grown:
            calls = self._calls(job_id, grown)
            self.node_calls += len(calls)

            async def one(chunk: list[int]) -> dict[int, runtime.RawRankStatus | RunnerError]:
                return await self._status_many(job_id, chunk, offsets, max_log, mark=False)

            for res in await self._bounded(one, calls):
                if isinstance(res, BaseException):
                    log.info("Reading new log bytes of job %s failed (next poll): %s", job_id, res)
                    continue
                for rank, got in res.items():
                    if not isinstance(got, BaseException) and got.log_chunk:
                        poll.chunks[rank] = (got.log_offset, got.log_chunk)
        return poll

    async def _agent_cancel(self, job_id: str, grace: float, wait: bool, reason: str) -> bool:
        """Cancel the whole gang through its head: one call (the head tells every agent at once, each
        stops its ranks as the node runtime's cancel does). ``wait``: then until the head says every
        rank ended (a call each 0.2 s, up to ``grace`` + 10 s). False: not done this way (no agent,
        the head did not answer or does not know the job, or ranks outlived the wait): the caller
        cancels the per-node way."""
        agent = await self.agent()
        if agent is None:
            return False
        try:
            self.agent_calls += 1
            await agent.cancel(job_id, reason or "cancelled")
            if not wait:
                return True
            deadline = time.monotonic() + grace + 10
            while time.monotonic() < deadline:
                self.agent_calls += 1
                if (await agent.status(job_id)).done:
                    return True
                await asyncio.sleep(0.2)
            log.warning(
                "Ranks of job %s outlived the head's cancel: cancelling them the per-node way", job_id
            )
        except AgentUnreachable as exc:
            self._agent_down(exc)
        except AgentError as exc:
            log.info("Cancelling job %s the per-node way: %s", job_id, exc)
            self._per_node_jobs.add(job_id)
        return False

    def _calls(self, job_id: str, ranks: Sequence[int], most: int = 0) -> list[list[int]]:
        """``ranks`` grouped by machine (``Backend.machine_of``), each group cut into chunks of at most
        :data:`CALL_RANKS` ranks and :data:`CALL_ARG_BYTES` of arguments: one remote call per chunk."""
        groups: dict[str, list[int]] = {}
        for rank in dict.fromkeys(ranks):
            groups.setdefault(self.backend.machine_of(self.node_of(rank)), []).append(rank)
        out: list[list[int]] = []
        for group in groups.values():
            chunk: list[int] = []
            size = 0
            for rank in group:
                # its arguments (quoted, on an SSH command line) and the log path the script builds
                cost = len(self.node_of(rank).root) + len(job_id) + 48
                if chunk and (len(chunk) >= (most or CALL_RANKS) or size + cost > CALL_ARG_BYTES):
                    out.append(chunk)
                    chunk, size = [], 0
                chunk.append(rank)
                size += cost
            if chunk:
                out.append(chunk)
        return out

    def _rank_error(self, rank: int, exc: BaseException) -> RunnerError:
        """A call's failure as seen by one of its ranks: named by that rank's own node address."""
        text = str(exc) or type(exc).__name__
        if isinstance(exc, RunnerError) and text.startswith(f"{exc.host}: "):
            text = text[len(exc.host) + 2 :]
        return RunnerError(self.node_of(rank).ip, text)

    async def _status_many(
        self,
        job_id: str,
        ranks: Sequence[int],
        offsets: Mapping[int, int],
        max_log: int,
        *,
        mark: bool,
        timeout: float = 30,
    ) -> dict[int, runtime.RawRankStatus | RunnerError]:
        """The status of ``ranks`` (all on one machine) and up to ``max_log`` log bytes of each from its
        offset: one call. Raises :class:`RunnerError` when the call fails or its answer cannot be
        read; a rank missing from the answer maps to its own error, never drops out silently.
        """
        nodes = [self.node_of(r) for r in ranks]
        queries = [(n.root, job_id, r, offsets.get(r, 0), max_log) for n, r in zip(nodes, ranks, strict=True)]
        args = runtime.status_args(queries, time.time() if mark else None)
        res = await self.runner(nodes[0]).arun_script(runtime.STATUS_SCRIPT, args, timeout=timeout)
        if res.returncode != 0:
            raise RunnerError(nodes[0].ip, f"status script failed: {res.error_text}")
        try:
            found = runtime.parse_status(res.stdout, {(job_id, r): offsets.get(r, 0) for r in ranks})
        except ValueError as exc:
            raise RunnerError(nodes[0].ip, f"unreadable status of ranks {_span(ranks)}: {exc}") from exc
        got = {raw.rank: raw for raw in found if raw.job_id == job_id}
        return {
            r: got.get(r) or RunnerError(n.ip, f"the status of rank {r} is missing from the node's answer")
            for n, r in zip(nodes, ranks, strict=True)
        }

    async def _status(
        self, job_id: str, rank: int, offset: int, max_log: int, *, mark: bool, timeout: float = 30
    ) -> runtime.RawRankStatus:
        """One rank's status (and up to ``max_log`` log bytes from ``offset``): one call to its node.

        Raises :class:`RunnerError` when the node cannot be asked or its answer cannot be read: a
        rank never silently drops out of the status.
        """
        found = await self._status_many(job_id, [rank], {rank: offset}, max_log, mark=mark, timeout=timeout)
        raw = found[rank]
        if isinstance(raw, RunnerError):
            raise raw
        return raw

    @property
    def call_limit(self) -> int:
        """Remote calls in flight at once (the backend's :attr:`Backend.call_limit`, else
        :data:`FANOUT_LIMIT`)."""
        return self.backend.call_limit or FANOUT_LIMIT

    async def _bounded(self, fn: Callable[[T], Awaitable[R]], calls: list[T]) -> list[R | BaseException]:
        """Make the calls (all at once, or :attr:`Backend.call_limit` at a time), but never wait past
        ``status_timeout`` for one that hangs.

        A dead or black-holed host would otherwise stall every poll of the gang for its connect
        retries. A call without an answer in time is cancelled (its runner kills the script and
        reaps it) and its ranks count as unreachable for the round; nothing is left running in the
        background, so the next round asks afresh and calls never pile up. With a call limit each
        call's time counts from its own start: 128 pods polled 16 at a time are not "unreachable"
        because the server took 8 s for all of them. Returns each call's result or exception.
        """
        timeout, limit = self.status_timeout, self.backend.call_limit
        if limit and len(calls) > limit:
            sem = asyncio.Semaphore(limit)

            async def one(call: T) -> R:
                async with sem:
                    return await asyncio.wait_for(fn(call), timeout)

            tasks = [asyncio.ensure_future(one(call)) for call in calls]
            deadline = timeout * -(-len(calls) // limit) + CANCEL_WAIT  # every round at its limit
        else:
            tasks = [asyncio.ensure_future(fn(call)) for call in calls]
            deadline = timeout
        try:
            if tasks:
                await asyncio.wait(tasks, timeout=deadline)
        finally:
            await cancel_bounded(tasks)
        late = RunnerError("", f"no answer within {timeout:g}s")
        out: list[R | BaseException] = []
        for task in tasks:
            if task.done() and not task.cancelled():
                exc = task.exception()
                out.append(late if isinstance(exc, asyncio.TimeoutError) else exc or task.result())
            else:  # cancelled, or its cancel did not finish in time (it ends on its own)
                out.append(late)
        return out

    def poll(
        self, job_id: str, offsets: Mapping[int, int] | None = None, max_log: int = DEFAULT_LOG_CHUNK
    ) -> Poll:
        return run_sync(self._once(self.apoll(job_id, offsets, max_log)))

    def peek(self, job_id: str, ranks: Sequence[int] | None = None) -> GangStatus:
        """Every rank's state now (or only ``ranks``': a rank task looking at its own rank costs one
        call), without log bytes and without a mark: a one-off look is no watcher (it must neither
        keep an abandoned job alive nor make the bridge step back)."""
        return run_sync(self._once(self.apoll(job_id, max_log=0, ranks=ranks, mark=False))).status

    async def aread_log(self, job_id: str, rank: int, offset: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` of a rank's log from ``offset``, and never more than 4 MiB: read in a loop.

        A direct call for one rank, not :meth:`apoll`, and not cut short by ``status_timeout``: a
        big read takes its time. The cap keeps any reader's memory bounded whatever a rank printed.
        Raises :class:`RunnerError`.
        """
        n = max(0, min(int(nbytes), 16 * DEFAULT_LOG_CHUNK))
        raw = await self._status(job_id, rank, offset, n, mark=False, timeout=60)
        return raw.log_chunk[:n]

    async def aread_range(
        self, job_id: str, rank: int, offset: int, end: int, chunk: int = READ_CHUNK
    ) -> AsyncIterator[bytes]:
        """A rank's log from ``offset`` to ``end``, ``chunk`` bytes per call (bounded memory, however
        much the rank printed); stops early if the log is shorter. Raises :class:`RunnerError`."""
        while offset < end:
            data = await self.aread_log(job_id, rank, offset, min(chunk, end - offset))
            if not data:
                return
            yield data
            offset += len(data)

    async def alog_tail(self, job_id: str, rank: int, size: int, nbytes: int = 2048) -> str:
        """The last ``nbytes`` (at most) of a rank's log of ``size`` bytes, as text."""
        start = max(0, size - nbytes)
        data = await self.aread_log(job_id, rank, start, size - start)
        return data.decode("utf-8", "replace")

    # -- cancel ---------------------------------------------------------------------------------

    async def acancel(
        self,
        job_id: str,
        ranks: Sequence[int] | None = None,
        grace: float = 3.0,
        *,
        wait: bool = True,
        reason: str = "",
        fail_fast: bool = False,
    ) -> None:
        """SIGTERM every process of every listed rank, SIGKILL after ``grace`` seconds.

        Processes are found by the mark they inherit, so a rank's background or re-parented children
        go too. ``wait=False`` (fail-fast) returns once the SIGTERMs are sent; the SIGKILL still follows
        on the node. ``reason`` is recorded with each unfinished rank (its state reads ``cancelled:
        <reason>``). ``fail_fast``: the first cancel after a rank failed; a machine whose failing rank
        already runs the machine's own cancel (it covers every rank there) is left to it.
        """
        wanted = list(range(self.num_ranks)) if ranks is None else list(ranks)
        if fail_fast and job_id not in self._per_node_jobs and self._agent is not None:
            return  # the head cancels the gang itself on a rank's failure, on every node at once
        if (
            ranks is None
            and job_id not in self._per_node_jobs
            and await self._agent_cancel(job_id, grace, wait, reason)
        ):
            return
        flags = self._gang_flags(job_id) if fail_fast and not wait and self.num_ranks > 1 else {}

        async def one(chunk: list[int]) -> None:
            nodes = [self.node_of(r) for r in chunk]
            targets = [(n.root, job_id, r) for n, r in zip(nodes, chunk, strict=True)]
            flag = flags.get(self.backend.machine_of(nodes[0]))
            args = runtime.cancel_args(grace, targets, wait=wait, reason=reason, unless_claimed=flag)
            res = await self.runner(nodes[0]).arun_script(runtime.CANCEL_SCRIPT, args, timeout=grace + 30)
            if res.returncode != 0:
                raise RunnerError(nodes[0].ip, f"cancel script failed: {res.error_text}")

        calls = self._calls(job_id, wanted)
        for chunk, res in zip(calls, await fan_out(one, calls, self.call_limit), strict=True):
            if isinstance(res, BaseException):
                ips = ", ".join(dict.fromkeys(self.node_of(r).ip for r in chunk))
                log.warning("Could not cancel ranks %s (%s): %s", _span(chunk), ips, res)

    def cancel(
        self, job_id: str, ranks: Sequence[int] | None = None, grace: float = 3.0, *, reason: str = ""
    ) -> None:
        run_sync(self._once(self.acancel(job_id, ranks, grace, reason=reason)))
