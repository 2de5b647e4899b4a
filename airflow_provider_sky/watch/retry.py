"""Whole-gang retries: which failures are retried (policy) and the watch loop that runs the attempts.

Why the whole gang: a rank retried alone would join peers that are gone (Airflow has no TaskGroup retries,
apache/airflow#21867). Why in the shared poll: like fail-fast, one place decides the gang's fate; the rank
tasks only report it, and stay the same task instances through every attempt. Why the nodes hold the
state: attempt k runs under the job id ``<job>.a<k>`` (``runtime_retry``), started from attempt 1's
files, so a watcher that restarted (a triggerer restart, a new bridge) finds where the gang is by looking
(attempt k+1 exists: follow it) and never starts an attempt twice (its ``mkdir`` is the claim).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.model.gang import (
    HUNG_PREFIX,
    LOST,
    ORPHANED_REASON,
    UNKNOWN,
    GangStatus,
    RankStatus,
)
from airflow_provider_sky.node import runtime, runtime_retry
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.watch import replace
from airflow_provider_sky.watch.hang import HangWatch, watch_gang
from airflow_provider_sky.watch.jobs import GangClient, Poll, fan_out
from airflow_provider_sky.watch.loop import MonitorState

log = logging.getLogger(__name__)

#: exit codes that fail the same way every time: retried only when listed in ``retry_on_exit_codes``
NEVER_BY_DEFAULT = frozenset({126, 127, 139})
#: ``retry_on_exit_codes="nonzero"``: every nonzero code but :data:`NEVER_BY_DEFAULT`
ANY_NONZERO = "nonzero"
#: longest wait between two attempts, whatever the backoff says
MAX_DELAY = 3600.0


@dataclass(frozen=True)
class RetryPolicy:
    """How often the whole gang is run again, after how long, and for which failures."""

    retries: int = 0
    delay: float = 0.0
    exponential: bool = False
    exit_codes: tuple[int, ...] = ()
    any_nonzero: bool = False

    @classmethod
    def build(
        cls,
        retries: Any = 0,
        retry_delay: Any = 0.0,
        retry_exponential_backoff: Any = False,
        retry_on_exit_codes: Any = (),
        *,
        names: tuple[str, str, str, str] = (
            "retries",
            "retry_delay",
            "retry_exponential_backoff",
            "retry_on_exit_codes",
        ),
    ) -> RetryPolicy:
        """The policy from user arguments, or a SpecError (a ValueError) naming the field (checked at DAG
        parse, with the timing arguments of :mod:`~airflow_provider_sky.spec.timing`)."""
        n_retries, n_delay, n_exp, n_codes = names
        if retries is None:
            retries = 0
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 100:
            raise SpecError(
                n_retries, f"expected a whole number of gang retries from 0 to 100, got {retries!r}"
            )
        if retry_delay is None:
            retry_delay = 0.0
        if hasattr(retry_delay, "total_seconds"):
            retry_delay = retry_delay.total_seconds()
        if isinstance(retry_delay, bool) or not isinstance(retry_delay, (int, float)):
            raise SpecError(n_delay, f"expected seconds (or a timedelta), got {retry_delay!r}")
        if not math.isfinite(retry_delay) or not 0 <= retry_delay <= MAX_DELAY:
            raise SpecError(n_delay, f"must be between 0 and {MAX_DELAY:g} seconds, got {retry_delay!r}")
        if not isinstance(retry_exponential_backoff, bool):
            raise SpecError(n_exp, f"expected True or False, got {retry_exponential_backoff!r}")
        any_nonzero = False
        codes: list[int] = []
        if isinstance(retry_on_exit_codes, str):
            if retry_on_exit_codes != ANY_NONZERO:
                raise SpecError(
                    n_codes,
                    f"expected a list of exit codes (e.g. [1, 137]) or {ANY_NONZERO!r}, "
                    f"got {retry_on_exit_codes!r}",
                )
            any_nonzero = True
        elif retry_on_exit_codes is not None:
            if isinstance(retry_on_exit_codes, int) or not isinstance(
                retry_on_exit_codes, (list, tuple, set)
            ):
                raise SpecError(
                    n_codes,
                    f"expected a list of exit codes (e.g. [1, 137]) or {ANY_NONZERO!r}, "
                    f"got {retry_on_exit_codes!r}",
                )
            for code in retry_on_exit_codes:
                if (
                    isinstance(code, bool)
                    or not isinstance(code, int)
                    or not (-64 <= code <= 255)
                    or code == 0
                ):
                    raise SpecError(
                        n_codes, f"{code!r} is not a nonzero exit code (1..255, or -N for a signal)"
                    )
                codes.append(code)
        return cls(
            int(retries),
            float(retry_delay),
            retry_exponential_backoff,
            tuple(sorted(set(codes))),
            any_nonzero,
        )

    @property
    def attempts(self) -> int:
        return self.retries + 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> RetryPolicy:
        if not data:
            return cls()
        return cls(
            int(data.get("retries", 0)),
            float(data.get("delay", 0.0)),
            bool(data.get("exponential", False)),
            tuple(int(c) for c in data.get("exit_codes", ())),
            bool(data.get("any_nonzero", False)),
        )

    def delay_before(self, attempt: int) -> float:
        """Seconds to wait before ``attempt`` (2 and up): ``delay``, doubled per attempt with backoff."""
        if attempt <= 1:
            return 0.0
        return min(MAX_DELAY, self.delay * (2 ** (attempt - 2) if self.exponential else 1))

    def verdict(self, status: GangStatus) -> tuple[bool, str]:
        """Whether a failed attempt is retried, and why, in words for the logs."""
        cause = status.root_cause()
        if cause is None:
            return False, "no rank failed: the gang was cancelled"
        who = f"rank {cause.rank}"
        if cause.state == LOST:
            return True, f"{who} was lost, retryable (lost nodes are retried)"
        if cause.reason.startswith(HUNG_PREFIX):
            return True, f"{who} {cause.reason}, retryable (hangs are retried)"
        if cause.reason == ORPHANED_REASON:
            return False, f"{who} was orphaned (nothing watched the job), not retryable"
        code = cause.exit_code
        said = f"{who} exited {code}" + (
            f" ({cause.reason})" if cause.reason != f"exited with code {code}" else ""
        )
        if code in self.exit_codes:
            return True, f"{said}, retryable by retry_on_exit_codes"
        if self.any_nonzero and code not in NEVER_BY_DEFAULT:
            return True, f"{said}, retryable by retry_on_exit_codes={ANY_NONZERO!r}"
        if code in NEVER_BY_DEFAULT:
            return (
                False,
                f"{said}, not retryable: it fails the same way every time (list {code} in retry_on_exit_codes to retry it)",
            )
        return False, f"{said}, not retryable (not in retry_on_exit_codes)"


#: the operators' names of the policy's arguments: ``retries``, ``retry_delay`` and
#: ``retry_exponential_backoff`` are BaseOperator's own (Airflow's retries of one task), so an operator
#: takes them with a ``gang_`` prefix; ``sky_gang`` takes them plain
OPERATOR_ARGS = ("gang_retries", "gang_retry_delay", "gang_retry_exponential_backoff", "retry_on_exit_codes")


def operator_policy(
    gang_retries: Any, gang_retry_delay: Any, gang_retry_exponential_backoff: Any, retry_on_exit_codes: Any
) -> RetryPolicy:
    """The gang retry policy from an operator's arguments (:data:`OPERATOR_ARGS`), checked."""
    return RetryPolicy.build(
        gang_retries,
        gang_retry_delay,
        gang_retry_exponential_backoff,
        retry_on_exit_codes,
        names=OPERATOR_ARGS,
    )


def pop_retry_args(kwargs: dict[str, Any]) -> RetryPolicy:
    """The gang retry policy from an operator's keyword arguments (removed from ``kwargs``), checked."""
    retries, delay, backoff, codes = (kwargs.pop(name, None) for name in OPERATOR_ARGS)
    return operator_policy(retries, delay, False if backoff is None else backoff, codes)


def operator_args(policy: RetryPolicy) -> dict[str, Any]:
    """``policy`` as the operators' keyword arguments (what :func:`pop_retry_args` reads back)."""
    codes: Any = ANY_NONZERO if policy.any_nonzero else list(policy.exit_codes)
    if policy.any_nonzero and policy.exit_codes:
        raise ValueError("retry_on_exit_codes: give either a list of codes or 'nonzero', not both")
    return dict(zip(OPERATOR_ARGS, (policy.retries, policy.delay, policy.exponential, codes), strict=True))


@dataclass
class GangPoll(Poll):
    """A poll of one attempt, and where the gang is in its attempts."""

    attempt: int = 1
    max_attempts: int = 1
    #: the attempts before this one: ``{"attempt", "job_id", "why", "message", "ranks": [rank dicts]}``
    history: list[dict[str, Any]] = field(default_factory=list)
    #: no further attempt will follow: the rank tasks may end
    final: bool = True
    #: why this attempt runs ("attempt 2/3: rank 2 exited 1, retryable by retry_on_exit_codes"), '' for 1
    note: str = ""
    #: the gang failed for good without this attempt's own failure saying why (a retry that could not start)
    error: str = ""
    #: why a failed final attempt is not retried ("no retry left", "... not retryable: ...")
    verdict: str = ""
    #: the root-cause rank's last lines of output (masked on the node), read once when it failed
    cause_tail: tuple[str, ...] = ()
    # cause, failure_message and message are worked out once per poll: every rank trigger of the gang reads
    # the same poll, and each asking anew is O(N) per trigger, O(N^2) per poll (seconds at 1,024 ranks)

    @functools.cached_property
    def cause(self) -> RankStatus | None:
        """``status.root_cause()``."""
        return self.status.root_cause()

    @functools.cached_property
    def failure_message(self) -> str:
        """``status.failure_message()``, then the root-cause rank's last lines of output: what it said
        before it failed is the first thing a user looks for, and was a click into its log away."""
        said = self.status.failure_message()
        cause = self.cause
        if said and cause is not None and self.cause_tail:
            said += f" Rank {cause.rank}'s last output: " + " | ".join(self.cause_tail)
        return said

    def message(self) -> str:
        """The gang's outcome in one paragraph: this attempt's root cause, then every earlier attempt's."""
        return self._message

    @functools.cached_property
    def _message(self) -> str:
        msg = self.error or self.failure_message
        if self.max_attempts > 1 and (self.history or self.attempt > 1):
            msg += f" (attempt {self.attempt}/{self.max_attempts})"
        if self.verdict and self.max_attempts > 1:
            msg += f"; not retried: {self.verdict}"
        for h in self.history:
            msg += f"; attempt {h['attempt']}: {h['message']} -> {h['why']}"
        return msg


@dataclass
class AttemptState:
    """What a watcher of the attempts carries between calls (the bridge re-enters after a lapse)."""

    attempt: int = 1
    current_id: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[int, str] = field(default_factory=dict)
    monitors: dict[int, MonitorState] = field(default_factory=dict)
    hangs: dict[int, HangWatch] = field(default_factory=dict)
    #: each failed attempt's root-cause rank and its last lines (:func:`cause_tail`), read once
    tails: dict[int, tuple[int | None, tuple[str, ...]]] = field(default_factory=dict)


def _gang_poll(poll: Poll, st: AttemptState, policy: RetryPolicy, **extra: Any) -> GangPoll:
    base = {f.name: getattr(poll, f.name) for f in dataclasses.fields(Poll)}
    return GangPoll(
        **base,
        attempt=st.attempt,
        max_attempts=policy.attempts,
        history=list(st.history),
        note=st.notes.get(st.attempt, ""),
        cause_tail=st.tails.get(st.attempt, (None, ()))[1],
        **extra,
    )


#: how many of the root-cause rank's last lines its failure message carries, and how much of each
CAUSE_LINES = 5
CAUSE_LINE_CHARS = 200
#: how much of the end of its log is read for them (one call, once per failed attempt)
CAUSE_TAIL_BYTES = 2048


async def cause_tail(client: GangClient, job_id: str, status: GangStatus) -> tuple[str, ...]:
    """The root-cause rank's last non-blank lines of output, as the node wrote its log (the job's
    secrets masked there already); none for a lost rank (its node may not answer) or on a read error."""
    cause = status.root_cause()
    if cause is None or cause.state == LOST or not cause.log_size:
        return ()
    try:
        text = await client.alog_tail(job_id, cause.rank, cause.log_size, CAUSE_TAIL_BYTES)
    except RunnerError as exc:
        log.warning("Could not read the end of rank %s's output: %s", cause.rank, exc)
        return ()
    lines = text.splitlines()
    if cause.log_size > CAUSE_TAIL_BYTES and lines:
        lines = lines[1:]  # the read began inside a line
    kept = [line.rstrip()[:CAUSE_LINE_CHARS] for line in lines if line.strip()]
    return tuple(kept[-CAUSE_LINES:])


async def watch_attempts(
    client: GangClient,
    job_id: str,
    *,
    policy: RetryPolicy | None = None,
    hang_timeout: float = 0.0,
    grace: float = 3.0,
    state: AttemptState | None = None,
    **watch_kwargs: Any,
) -> AsyncGenerator[GangPoll, None]:
    """Watch attempt after attempt until the gang's outcome is final; yields every poll.

    An attempt that ends failed and retryable (:meth:`RetryPolicy.verdict`) yields its last poll with
    ``final=False``; then attempt k+1 is started (after ``delay``, once no process of attempt k is left)
    unless it exists already (another watcher started it: followed at once). The last poll has
    ``final=True``.
    """
    policy = policy or RetryPolicy()
    st = state or AttemptState()
    if policy.retries:
        await replace.refresh_handle(client)  # a lost node may have been replaced before we (re)started
    while True:
        aid = runtime_retry.attempt_job_id(job_id, st.attempt)
        st.current_id = aid
        last: Poll | None = None
        async with contextlib.aclosing(
            watch_gang(
                client,
                aid,
                hang_timeout=hang_timeout,
                hangs=st.hangs.setdefault(st.attempt, HangWatch(hang_timeout)),
                state=st.monitors.setdefault(st.attempt, MonitorState()),
                grace=grace,
                **watch_kwargs,
            )
        ) as polls:
            async for poll in polls:
                last = poll
                cause = poll.status.root_cause() if poll.status.failed else None
                if cause is not None and st.tails.get(st.attempt, (None, ()))[0] != cause.rank:
                    # read once the fail-fast cancel is out (watch sent it before yielding this poll)
                    st.tails[st.attempt] = (cause.rank, await cause_tail(client, aid, poll.status))
                if poll.status.done:
                    break
                yield _gang_poll(poll, st, policy, final=False)
        assert last is not None
        status = last.status
        retry, why = (False, "") if status.succeeded else policy.verdict(status)
        if not retry or st.attempt >= policy.attempts:
            if retry:
                log.info("Job %s: attempt %s/%s failed; no retry left", job_id, st.attempt, policy.attempts)
            elif not status.succeeded and policy.retries:  # without retries, no talk of retrying
                log.info("Job %s: attempt %s failed, %s", job_id, st.attempt, why)
            verdict = ""
            if not status.succeeded:
                verdict = f"no retry left (retries={policy.retries})" if retry else why
            if policy.retries:
                await _forget(client, job_id)
            yield _gang_poll(last, st, policy, final=True, verdict=verdict)
            return
        nxt = st.attempt + 1
        note = f"attempt {nxt}/{policy.attempts}: {why}"
        yield _gang_poll(last, st, policy, final=False)  # the rank tasks log this attempt's end
        error, replaced = await _next_attempt(
            client, job_id, st.attempt, policy, grace, status, watch_kwargs.get("poll_interval", 0.5)
        )
        entry = {
            "attempt": st.attempt,
            "job_id": aid,
            "why": why + replaced,  # the rank tasks' boundary line says it too
            "message": status.failure_message(),
            "ranks": [r.to_dict() for r in status.ranks],
        }
        if error:
            log.warning("Job %s: %s", job_id, error)
            await _forget(client, job_id)
            yield _gang_poll(last, st, policy, final=True, error=f"{status.failure_message()}; {error}")
            return
        note += replaced
        log.info("Job %s: %s", job_id, note)
        st.history.append(entry)
        st.attempt = nxt
        st.notes[nxt] = note


def _missing(status: GangStatus) -> list[int]:
    """The ranks of an attempt whose directory does not exist (not started, by anyone, yet)."""
    return [r.rank for r in status.ranks if r.state == LOST and r.reason.endswith("job directory is gone")]


#: seconds a watcher that finds an attempt being started by another waits for all of its ranks
FOLLOW_TIMEOUT = 90.0


async def _next_attempt(
    client: GangClient,
    job_id: str,
    attempt: int,
    policy: RetryPolicy,
    grace: float,
    status: GangStatus | None = None,
    poll_interval: float = 0.5,
) -> tuple[str, str]:
    """Start attempt ``attempt + 1``: ('', what was replaced for it) once started, else (why not, '').

    The wait (``retry_delay``) runs to a due time kept on the nodes, so a watcher that restarted during
    it waits only what is left. Then lost nodes are replaced (``replace``), what attempt ``attempt``
    left is killed and checked gone, and every rank starts."""
    nxt = attempt + 1
    nid = runtime_retry.attempt_job_id(job_id, nxt)
    await replace.refresh_handle(client)  # another watcher may have replaced a node already
    peek = (await client.apoll(nid, max_log=0, mark=False)).status
    if any(r.state != UNKNOWN and r.rank not in _missing(peek) for r in peek.ranks):
        # another watcher (or our earlier self) started it: follow it once each of its ranks exists (a
        # rank not created yet would read as lost and fail the attempt)
        deadline = time.monotonic() + FOLLOW_TIMEOUT
        while _missing(peek) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            peek = (await client.apoll(nid, max_log=0, mark=False)).status
        log.info("Job %s: following attempt %s, started by another watcher", job_id, nxt)
        return "", await replace.recorded_note(client, job_id, status, nxt) if status is not None else ""
    delay = policy.delay_before(nxt)
    if delay:
        due = await _due(client, job_id, nxt, time.time() + delay)
        wait = max(0.0, min(delay, due - time.time()))
        if wait < delay - 0.5:
            log.info(
                "Job %s: attempt %s in %.1fs (the rest of its %.1fs retry_delay)", job_id, nxt, wait, delay
            )
        else:
            log.info("Job %s: attempt %s in %.1fs (retry_delay)", job_id, nxt, wait)
        await asyncio.sleep(wait)
    replaced = ""
    if status is not None and replace.lost_ranks(status):
        done = await replace.replace_once(client, job_id, status, nxt, poll_interval)
        if done.error:
            return f"attempt {nxt} not started: {done.error}", ""
        replaced = done.note()
    left = await _clean(client, runtime_retry.attempt_job_id(job_id, attempt))
    if left:
        return f"attempt {nxt} not started: processes of attempt {attempt} still run ({left})", ""
    return await _relaunch(client, job_id, nxt, grace), replaced


async def _per_machine(
    client: GangClient, job_id: str, script: str, args_of: Any
) -> list[str | BaseException]:
    """Run ``script`` once per machine over all ranks; ``args_of(chunk)`` builds its arguments."""

    async def one(chunk: list[int]) -> str:
        node = client.node_of(chunk[0])
        res = await client.runner(node).arun_script(script, args_of(chunk), timeout=60 + len(chunk))
        if res.returncode != 0:
            raise RunnerError(node.ip, res.error_text)
        return res.text

    calls = client._calls(job_id, list(range(client.num_ranks)))
    return await fan_out(one, calls, client.call_limit)


def _triples(client: GangClient, job_id: str, chunk: Sequence[int]) -> list[str]:
    args: list[str] = []
    for r in chunk:
        args += [client.node_of(r).root, runtime.check_job_id(job_id), str(r)]
    return args


async def _clean(client: GangClient, aid: str) -> str:
    """SIGKILL what attempt ``aid`` left and check that nothing of it runs: '' or what is left."""
    out = await _per_machine(client, aid, runtime_retry.CLEAN_SCRIPT, lambda c: _triples(client, aid, c))
    left = []
    for res in out:
        if isinstance(res, BaseException):
            left.append(f"could not check: {res}")
        else:
            left += [line for line in res.splitlines() if line.startswith("LEFT")]
    return "; ".join(left)


async def _relaunch(client: GangClient, job_id: str, attempt: int, grace: float = 3.0) -> str:
    """Start every rank of ``attempt`` from attempt 1's files: '' when each started (or existed).

    Through the head's agent when it runs attempt 1 (one call; the head then decides this attempt's
    fate as the first's, with or without a watcher), else one call per machine."""
    now = time.time()
    aid = runtime_retry.attempt_job_id(job_id, attempt)
    flags = client._gang_flags(aid) if client.num_ranks > 1 else {}

    def args_with(flag: str, chunk: list[int]) -> list[str]:
        targets = [(client.node_of(r).root, r) for r in chunk]
        return runtime_retry.relaunch_args(job_id, attempt, now, targets, client.handle.ips, flag)

    def args_of(chunk: list[int]) -> list[str]:
        return args_with(flags.get(client.backend.machine_of(client.node_of(chunk[0])), ""), chunk)

    script = runtime_retry.RELAUNCH_SCRIPT
    out = await client.agent_restart(job_id, aid, script, args_with, grace)
    if out is None:
        out = await _per_machine(client, job_id, script, args_of)
    words: dict[str, list[str]] = {}
    errors = [str(res) for res in out if isinstance(res, BaseException)]
    for res in out:
        if isinstance(res, str):
            for line in res.splitlines():
                parts = line.split()
                if len(parts) >= 2:
                    words.setdefault(parts[0], []).append(parts[1])
    bad = {w: rs for w, rs in words.items() if w not in ("STARTED", "EXISTS")}
    if not errors and not bad:
        return ""
    await client.acancel(aid, grace=1.0, reason=f"attempt {attempt} could not start")
    if "STOPPED" in bad:
        return f"attempt {attempt} not started: a user stopped the gang (marked a task failed or cleared it)"
    said = "; ".join(errors + [f"{w} ranks {', '.join(rs)}" for w, rs in bad.items()])
    return f"attempt {attempt} could not start: {said}"


async def _due(client: GangClient, job_id: str, attempt: int, due: float) -> float:
    """When ``attempt`` is due: the time the first watcher wrote on the nodes, else ``due`` (written now).

    A watcher that restarted during the retry delay (a triggerer restart, a new bridge) reads it back
    instead of waiting the whole delay again; nodes that do not answer are skipped."""
    out = await _per_machine(
        client,
        job_id,
        runtime_retry.DUE_SCRIPT,
        lambda c: [str(int(attempt)), f"{due:.3f}", *_triples(client, job_id, c)],
    )
    found = []
    for res in out:
        if isinstance(res, str):
            for line in res.split():
                with contextlib.suppress(ValueError):
                    found.append(float(line))
    return min(found) if found else due


async def _forget(client: GangClient, job_id: str) -> None:
    """The outcome is final: the kept secrets of attempt 1 go (best effort)."""
    out = await _per_machine(
        client, job_id, runtime_retry.FORGET_SCRIPT, lambda c: _triples(client, job_id, c)
    )
    for res in out:
        if isinstance(res, BaseException):
            log.warning("Could not remove the kept secrets of job %s: %s", job_id, res)


async def stop_gang(client: GangClient, job_id: str, attempts: int, grace: float, reason: str) -> None:
    """A user acted on a task of the gang: no further attempt starts, and every attempt's ranks are cancelled."""
    out = await _per_machine(
        client, job_id, runtime_retry.STOP_SCRIPT, lambda c: [reason, *_triples(client, job_id, c)]
    )
    for res in out:
        if isinstance(res, BaseException):
            log.warning("Could not mark job %s stopped: %s", job_id, res)
    for k in range(1, max(1, attempts) + 1):
        await client.acancel(runtime_retry.attempt_job_id(job_id, k), grace=grace, reason=reason)


def rank_attempts(poll: GangPoll, rank: int) -> list[dict[str, Any]]:
    """One rank's outcome in every attempt so far (for the ``sky_rank`` XCom)."""
    keys = ("state", "exit_code", "reason", "start", "end")
    out = []
    for h in poll.history:
        for r in h["ranks"]:
            if r["rank"] == rank:
                out.append({"attempt": h["attempt"], "job_id": h["job_id"], **{k: r.get(k) for k in keys}})
    try:
        cur: RankStatus | None = poll.status.by_rank(rank)
    except KeyError:
        cur = None
    if cur is not None:
        out.append(
            {"attempt": poll.attempt, "job_id": poll.status.job_id, **{k: cur.to_dict()[k] for k in keys}}
        )
    return out
