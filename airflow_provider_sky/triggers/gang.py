"""Triggers that watch a gang. All triggers of one job share one poll loop inside a triggerer.

The shared poll (``open_shared_stream``) makes one status call per node per interval, whatever the
number of rank triggers and sensors watching, so the cost of watching N ranks is O(N). The fail-fast
policy runs inside that poll (``watch.watch``): cancelling siblings from the triggerer takes well under
a second, whereas waiting for a worker to pick up an event would add the scheduler's latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Hashable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import greenback
from airflow.triggers.base import BaseEventTrigger, TaskFailedEvent, TaskSuccessEvent, TriggerEvent

from airflow_provider_sky.hooks.sky import SkyHook
from airflow_provider_sky.model.gang import (
    BAD,
    CANCELLED,
    FAILED,
    SUCCEEDED,
    GangStatus,
)
from airflow_provider_sky.model.logtext import LineClock, LineSplitter, iso_time
from airflow_provider_sky.runners.base import RunnerError
from airflow_provider_sky.triggers import task_states
from airflow_provider_sky.triggers.log_room import log_room
from airflow_provider_sky.triggers.outcome import (
    attempt_boundary,
    cancel_text,
    gang_outcome,
    rank_end_lines,
    rank_outcome,
    rank_summary,
    root_cause_line,
)
from airflow_provider_sky.watch.jobs import GangClient, Poll
from airflow_provider_sky.watch.linetimes import aread_times
from airflow_provider_sky.watch.result import ResultError, read_result
from airflow_provider_sky.watch.retry import GangPoll, rank_attempts, stop_gang, watch_attempts
from airflow_provider_sky.watch.settings import WatchFields, WatchSettings

if TYPE_CHECKING:
    import jinja2
    from airflow.sdk import Context

T = TypeVar("T")

#: log lines written between two yields to the event loop
LOG_BATCH = 500


#: a trigger kwarg ``{XCOM: [task_id, key]}`` is that upstream XCom, read in the triggerer (``pulled``)
XCOM = "__sky_xcom__"
#: a rank trigger's ``rank`` until the triggerer sets it: the task's map index
MAP_INDEX = "{{ ti.map_index }}"
_PULLED: dict[tuple[Any, ...], Any] = {}
_PULLED_MAX = 256
#: reads under way (``pulled``): the triggers asking for the same XCom meanwhile wait for that one
_PULLING: dict[tuple[Any, ...], asyncio.Future[Any]] = {}


class _PullAbandoned(Exception):
    """The trigger reading an XCom others wait for did not get it: each waiter reads it itself."""


def xcom_ref(task_id: str, key: str = "return_value") -> dict[str, list[str]]:
    """A trigger kwarg the triggerer replaces with an upstream (unmapped) task's XCom."""
    return {XCOM: [task_id, key]}


def pulled(context: Context, value: Any) -> Any:
    """``value``, or the XCom it refers to (``xcom_ref``), read once per job per triggerer.

    Every rank trigger of a gang needs the same two XComs (the cluster handle, the job id). Asked by
    each, a 1,024-rank gang would make 2,048 requests through the triggerer's supervisor (0.1 s each,
    one at a time here) and hold 1,024 copies of the handle. Keyed by the reader's try number: a
    cleared gang runs its rank tasks again with a new try, and reads the new job.

    The triggers of a gang start together, and a read yields the event loop while the supervisor
    answers (Airflow runs a trigger's sync calls through ``greenback``), so the others would each miss
    the cache and ask too: the first 1,024-rank trigger then had its second XCom only after all 1,024
    first ones were answered, and the gang's shared poll began ~17 s after the triggers, after the job's
    ranks had ended. A trigger that finds a read of the same XCom under way waits for it instead.
    """
    if not (isinstance(value, dict) and set(value) == {XCOM}):
        return value
    task_id, key = value[XCOM]
    ti = context["ti"]
    cache_key = (ti.dag_id, ti.run_id, ti.try_number, task_id, key)
    while cache_key not in _PULLED:
        under_way = _PULLING.get(cache_key)
        if under_way is None or not _can_wait():
            return _pull(ti, cache_key, task_id, key)
        try:
            greenback.await_(asyncio.shield(under_way))
        except _PullAbandoned:
            continue  # that reader failed: the next turn reads it (or waits for whoever does)
    return _PULLED[cache_key]


def _can_wait() -> bool:
    """Whether this sync code runs in a trigger that may wait on the event loop (greenback's portal)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return bool(greenback.has_portal())


def _pull(ti: Any, cache_key: tuple[Any, ...], task_id: str, key: str) -> Any:
    """Read the XCom (announcing the read to the triggers that ask for it meanwhile) and cache it."""
    waiting: asyncio.Future[Any] | None = None
    if _can_wait():
        waiting = asyncio.get_running_loop().create_future()
        _PULLING[cache_key] = waiting
    try:
        found = ti.xcom_pull(task_ids=task_id, key=key, map_indexes=-1)
        if found is None:
            raise ValueError(f"no XCom {key!r} of task {task_id} in run {ti.run_id}: did that task run?")
        if len(_PULLED) >= _PULLED_MAX:
            _PULLED.pop(next(iter(_PULLED)))
        _PULLED[cache_key] = found
        return found
    finally:
        if waiting is not None:
            if _PULLING.get(cache_key) is waiting:
                del _PULLING[cache_key]
            if cache_key in _PULLED:
                waiting.set_result(None)
            else:  # failed or cancelled: the waiters read it themselves (and meet the same error)
                waiting.set_exception(_PullAbandoned())
                waiting.exception()  # retrieved: a future nobody awaited must not be logged


async def _newest(stream: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """``stream``, read by a task of its own that keeps only the newest item: older ones are dropped.

    The triggerer queues every poll for a subscriber that is busy (logging a long output, reading
    the rest of an ended rank), and each poll holds up to a chunk of every rank's log: a slow rank
    trigger would come to hold its rank's whole output (and fail once 1024 polls wait). Dropping
    a poll loses nothing: the rank trigger reads any gap in its rank's log itself.
    """
    newest: list[T] = []
    ended: list[BaseException | None] = []
    ready = asyncio.Event()

    async def pump() -> None:
        try:
            async for item in stream:
                newest[:] = [item]
                ready.set()
            ended.append(None)
        except Exception as exc:  # the shared poll failed: the subscriber sees it next
            ended.append(exc)
        finally:
            ready.set()

    task = asyncio.ensure_future(pump())
    try:
        while True:
            if not newest and not ended:
                ready.clear()
                await ready.wait()
            if newest:
                yield newest.pop()
            elif ended[0] is not None:
                raise ended[0]
            else:
                return
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class _SkyGangWatchTrigger(WatchFields, BaseEventTrigger):
    """Common part: kwargs, the shared poll and ``on_kill`` (a user's mark-failed cancels the gang)."""

    def __init__(
        self,
        *,
        cluster: dict[str, Any],
        job_id: str,
        sky_conn_id: str | None = SkyHook.default_conn_name,
        poll_interval: float = 0.5,
        grace: float = 3.0,
        lost_after: float = 10.0,
        fire_after: float | None = None,
        end_from_trigger: bool = False,
        hang_timeout: float = 0.0,
        retry: dict[str, Any] | None = None,
    ) -> None:
        #: how the gang is watched (the same for every trigger of the job)
        self.watch = WatchSettings.from_kwargs(
            {
                "sky_conn_id": sky_conn_id,
                "poll_interval": poll_interval,
                "grace": grace,
                "lost_after": lost_after,
                "hang_timeout": hang_timeout,
                "retry": retry,
            }
        )
        super().__init__()
        #: a handle, or (a task started in the triggerer) an ``xcom_ref`` to the cluster task's handle
        self.cluster: Any = cluster
        self.job_id = job_id
        self.fire_after = None if fire_after is None else float(fire_after)
        #: end the task from here (TaskSuccessEvent / TaskFailedEvent) instead of resuming it on a worker
        self.end_from_trigger = bool(end_from_trigger)

    def render_template_fields(self, context: Context, jinja_env: jinja2.Environment | None = None) -> None:
        """A task started in the triggerer gets its cluster, job and rank from the upstream XComs and its
        map index: turn them into values before the shared poll keys on them.

        Our own placeholders (``xcom_ref``, :data:`MAP_INDEX`) are read directly; only other values (a
        user's templates) go through Jinja, which compiles each string anew: per rank trigger that was
        most of the triggerer's CPU while a 1,024-rank gang's triggers started (py-spy, figure 5).
        """
        rest = []
        for name in self.template_fields:
            value = getattr(self, name)
            if isinstance(value, str) and value == MAP_INDEX:
                setattr(self, name, context["ti"].map_index)
            elif not (isinstance(value, dict) and set(value) == {XCOM}):
                rest.append(name)
        if rest:
            env = jinja_env or self.get_template_env()
            self._do_render_template_fields(self, rest, context, env, set())
        self.cluster = pulled(context, self.cluster)
        self.job_id = pulled(context, self.job_id)
        self._settle()

    def _settle(self) -> None:
        if not isinstance(self.cluster, dict) or "name" not in self.cluster:
            raise ValueError(f"cluster: expected the cluster task's handle, got {str(self.cluster)[:200]!r}")
        self.job_id = str(self.job_id)

    def _common_kwargs(self) -> dict[str, Any]:
        return {
            "cluster": self.cluster,
            "job_id": self.job_id,
            **self.watch.to_kwargs(),
            "fire_after": self.fire_after,
            "end_from_trigger": self.end_from_trigger,
        }

    async def _hold(self) -> None:
        """Emit no earlier than ``fire_after`` (epoch seconds); see ``compat.resume_hold``,
        and, when the task ends here (its last lines logged here), once the log channel has room.

        Only the event waits: the fail-fast cancel has already run in the shared poll.
        """
        if self.fire_after is not None:
            await asyncio.sleep(max(0.0, self.fire_after - time.time()))
        if self.end_from_trigger:
            await log_room()

    def shared_stream_key(self) -> Hashable | None:
        self._settle()
        return (
            "airflow-provider-sky",
            self.sky_conn_id,
            self.cluster["name"],
            self.job_id,
            self.poll_interval,
            self.hang_timeout,
            json.dumps(self.retry, sort_keys=True),
        )

    @classmethod
    async def open_shared_stream(
        cls, kwargs: dict[str, Any]
    ) -> AsyncGenerator[tuple[Poll, GangClient], None]:
        """Poll the job (fail-fast, hangs and whole-gang retries included) and yield ``(GangPoll, client)``;
        once the outcome is final, repeat the end."""
        watch = WatchSettings.from_kwargs(kwargs)
        client = await SkyHook(watch.sky_conn_id).aclient(kwargs["cluster"])
        try:
            # secrets never travel in trigger kwargs: the nodes mask them before output reaches the log
            last: GangPoll | None = None
            async for poll in watch_attempts(
                client,
                kwargs["job_id"],
                policy=watch.retry,
                poll_interval=watch.poll_interval,
                grace=watch.grace,
                lost_after=watch.lost_after,
                hang_timeout=watch.hang_timeout,
            ):
                last = poll
                yield poll, client
            assert last is not None
            while True:  # finished: late subscribers get the final picture without remote calls
                yield dataclasses.replace(last, chunks={}, at=time.time()), client
                await asyncio.sleep(watch.poll_interval)
        finally:
            client.close()

    async def run(self) -> AsyncIterator[TriggerEvent]:
        """Standalone path (``dag.test()``, or a triggerer without shared streams): the same code."""
        self._settle()
        _, kwargs = self.serialize()
        async with contextlib.aclosing(type(self).open_shared_stream(kwargs)) as stream:
            async for event in self._watch(stream):
                yield event
                return

    def _watch(self, polls: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        """The trigger's events from a stream of polls (its own poll's, or the triggerer's shared one)."""
        return self.filter_shared_stream(polls)

    def _task_label(self, ti: Any) -> str:
        return f"task {ti.task_id}" if ti is not None else "a task watching the gang"

    def _user_action(self) -> str:
        """The cancel reason every rank shows: which task a user acted on (the triggerer tells us)."""
        ti = self.task_instance
        where = f" of DAG {ti.dag_id}, run {ti.run_id}," if ti is not None else ""
        # Airflow calls on_kill for a mark-failed, a mark-success or a clear, and does not say which
        return f"{self._task_label(ti)}{where} was marked failed, marked success or cleared by a user"

    async def _still_deferred(self) -> bool:
        """Whether our task instance is still deferred, i.e. no user acted on it.

        Airflow also calls ``on_kill`` on a triggerer that stalled past ``[triggerer]
        triggerer_health_check_threshold`` and then finds its triggers given to another triggerer
        (it cancels its copies with the user-action signal): the gang must live on there. A user's
        mark-failed / mark-success / clear has changed the state before the trigger is cancelled.
        """
        ti = self.task_instance
        if ti is None:
            return False
        try:
            from airflow.sdk.execution_time.task_runner import RuntimeTaskInstance
            from asgiref.sync import sync_to_async

            states = await sync_to_async(RuntimeTaskInstance.get_task_states)(
                dag_id=ti.dag_id, map_index=ti.map_index, task_ids=[ti.task_id], run_ids=[ti.run_id]
            )
        except Exception:  # no supervisor to ask (dag.test) or the API failed: act as told
            self.log.warning(
                "Could not read the state of %s: acting on the cancel", ti.task_id, exc_info=True
            )
            return False
        key = ti.task_id if ti.map_index is None or ti.map_index < 0 else f"{ti.task_id}_{ti.map_index}"
        state = (states.get(ti.run_id) or {}).get(key)
        return str(state) == "deferred"  # TaskInstanceState is a str enum

    async def on_kill(self) -> None:
        """A user marked the deferred task failed / cleared it: cancel the whole gang, saying who, and
        start no further attempt. A trigger moved to another triggerer (its task still deferred) cancels
        nothing."""
        if await self._still_deferred():
            self.log.info(
                "Trigger moved to another triggerer (task still deferred): job %s keeps running", self.job_id
            )
            return
        reason = self._user_action()
        self.log.info("Task acted on by a user: cancelling every rank of job %s (%s)", self.job_id, reason)
        client = await SkyHook(self.sky_conn_id).aclient(self.cluster)
        try:
            attempts = self.watch.retry.attempts
            await stop_gang(client, self.job_id, attempts, self.grace, reason)
        finally:
            client.close()


#: polls a cancelled rank waits for the rank that failed first to show its own exit record
CAUSE_WAIT_POLLS = 10


class SkyRankTrigger(_SkyGangWatchTrigger):
    """Fires when one rank ends; meanwhile logs the rank's output as it appears."""

    def __init__(self, *, rank: int | str, log_offset: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: an int, or "{{ ti.map_index }}" until the triggerer renders it (a task started in the triggerer)
        self.rank: Any = rank if isinstance(rank, str) and "{" in rank else int(rank)
        self.log_offset = int(log_offset)

    def _settle(self) -> None:
        super()._settle()
        self.rank = int(self.rank)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs = {
            **self._common_kwargs(),
            "rank": self.rank,
            "log_offset": self.log_offset,
        }
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    def _task_label(self, ti: Any) -> str:
        if ti is None:
            return f"the task watching rank {self.rank}"
        map_index = getattr(ti, "map_index", -1)
        extra = "" if map_index in (-1, self.rank, None) else f", map index {map_index}"
        return f"rank task {ti.task_id} [rank {self.rank}{extra}]"

    async def _log_lines(self, lines: Iterable[tuple[int, str]], clock: LineClock | None = None) -> None:
        """Log each line of output, dated when its node printed it (``clock``, else now); blank lines
        are left out (an empty ``INFO -`` line tells a reader nothing). Every ``LOG_BATCH`` lines let the
        triggerer's other work run.

        A read of short lines is thousands of log calls: done in one go, they would hold up every
        other trigger of the triggerer, fail-fast polls included, for a good fraction of a second.
        """
        last_at, stamp = None, ""  # the lines of one read mostly share a time: format it once
        for i, (offset, line) in enumerate(lines, 1):
            if line.strip(" \t\r\f\v"):
                await log_room()
                at = clock.time_of(offset) if clock is not None else None
                if at is None:
                    self.log.info("%s", line)
                else:
                    if at != last_at:
                        last_at, stamp = at, iso_time(at)
                    self.log.info("%s", line, timestamp=stamp)
            if i % LOG_BATCH == 0:
                await asyncio.sleep(0)

    async def _catch_up(
        self,
        client: GangClient,
        lines: LineSplitter,
        offset: int,
        end: int,
        job_id: str | None = None,
        clock: LineClock | None = None,
    ) -> int:
        """Log the rank's output from ``offset`` to ``end`` in bounded reads; returns where it got to.

        One call for the whole rest would hold all of it at once (a rank printing 200 MB drove the
        watcher past 1 GB). Read late, the lines are dated from the node's records (``linetimes``).
        """
        if clock is not None and offset < end:
            await aread_times(client, job_id or self.job_id, self.rank, offset, end, clock)
        try:
            async for data in client.aread_range(job_id or self.job_id, self.rank, offset, end):
                await self._log_lines(lines.feed_at(data), clock)
                offset += len(data)
        except RunnerError as exc:
            self.log.warning("Could not read rank %s's output past byte %s: %s", self.rank, offset, exc)
        return offset

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        """In the triggerer: polls that came while we were busy logging are dropped, not kept (``_newest``)."""
        async with contextlib.aclosing(_newest(shared_stream)) as polls:
            async with contextlib.aclosing(self._watch(polls)) as events:
                async for event in events:
                    yield event
                    return

    async def _watch(self, polls: AsyncIterator[Any]) -> AsyncGenerator[TriggerEvent, None]:
        expected = self.log_offset
        lines = LineSplitter(offset=expected)  # the nodes masked the job's secrets already
        clock = LineClock()  # when the nodes saw each part of this attempt's log
        attempt, ended = 1, 0  # the attempt whose log we stream; the last attempt whose end we logged
        seen_at = None  # when the last poll we logged from was taken
        waited = 0  # polls this rank, cancelled, waited for the cause of its cancel to show
        async for poll, client in polls:
            assert isinstance(poll, GangPoll) and isinstance(client, GangClient)
            if poll.attempt > attempt:  # a retry: finish the attempts we did not see end, then a boundary
                for h in poll.history:
                    if h["attempt"] < attempt or h["attempt"] <= ended:
                        continue
                    await log_room()
                    if h["attempt"] > attempt:
                        expected, lines, clock = 0, LineSplitter(), LineClock()
                        self.log.info("%s", attempt_boundary(poll, h["attempt"]))
                    mine = next((r for r in h["ranks"] if r["rank"] == self.rank), None)
                    if mine is not None:
                        expected = await self._catch_up(
                            client, lines, expected, mine["log_size"], h["job_id"], clock
                        )
                        await self._log_lines(lines.flush_at(), clock)
                        self.log.info(
                            "attempt %s: %s", h["attempt"], rank_outcome({"rank": self.rank, **mine})
                        )
                    ended = h["attempt"]
                attempt, expected, lines, clock = poll.attempt, 0, LineSplitter(), LineClock()
                await log_room()
                self.log.info("%s", attempt_boundary(poll, attempt))
            try:
                st = poll.status.by_rank(self.rank)
            except KeyError:
                continue
            job_id = poll.status.job_id
            off, data = poll.chunks.get(self.rank, (st.log_size, b""))
            if data and (seen_at is None or poll.at - seen_at > 2 * self.poll_interval + 0.5):
                # bytes older than one poll (joined late, polls dropped): the node's records date them
                await aread_times(client, job_id, self.rank, expected, off + len(data), clock)
            seen_at = poll.at
            clock.add(st.log_size, poll.at)
            clock.forget_before(expected)
            if expected < off:  # joined late, or the stream read past us: fetch the gap ourselves
                expected = await self._catch_up(client, lines, expected, off, job_id, clock)
            if off <= expected < off + len(data):
                await self._log_lines(lines.feed_at(data[expected - off :]), clock)
                expected = off + len(data)
            if not st.terminal:
                continue
            if (
                not poll.final and poll.max_attempts > 1
            ):  # over for us in this attempt; the gang may be retried
                if ended < attempt:
                    expected = await self._catch_up(client, lines, expected, st.log_size, job_id, clock)
                    await self._log_lines(lines.flush_at(), clock)
                    outcome = {"rank": self.rank, **st.to_dict()}
                    await log_room()
                    self.log.info("attempt %s: %s", attempt, rank_outcome(outcome))
                    ended = attempt
                continue
            if (
                st.state == CANCELLED
                and poll.cause is None
                and waited < CAUSE_WAIT_POLLS
                and not poll.status.done
            ):
                # a failing rank signals its siblings before it records its own exit: a poll between the
                # two sees this rank cancelled and no cause yet, which a later poll has (the gang still runs)
                waited += 1
                continue
            # the rank is over: log the rest of its output, then its unfinished last line
            expected = await self._catch_up(client, lines, expected, st.log_size, job_id, clock)
            await self._log_lines(lines.flush_at(), clock)
            cause = poll.cause
            await self._hold()
            if st.state == SUCCEEDED:
                message = f"rank {self.rank} ({st.ip}) succeeded"
                if poll.attempt > 1:
                    message += f" on attempt {poll.attempt}/{poll.max_attempts}"
            elif st.state in BAD or poll.error:
                message = poll.message()
            else:
                message = f"rank {self.rank} ({st.ip}) {st.state}: " + cancel_text(poll)
                message += poll.message()[len(poll.failure_message) :] if poll.history else ""
            payload = {
                "kind": "rank",
                "job_id": self.job_id,
                "rank": self.rank,
                "ip": st.ip,
                "state": st.state.value,  # the plain string: events and XComs carry no enum
                "exit_code": st.exit_code,
                "reason": st.reason,
                "duration": (st.end - st.start) if st.end and st.start else None,
                "start": st.start,
                "end": st.end,
                "log_offset": expected,
                "message": message,
                "root_cause": cause.to_dict() if cause else None,
                "cause_tail": list(poll.cause_tail),
                "attempt": poll.attempt,
                "attempts": rank_attempts(poll, self.rank),
                "headline": root_cause_line(poll.status, st, cause, (poll.cause_tail or ("",))[-1])
                if st.state != SUCCEEDED
                else "",
            }
            yield self._end_event(payload) if self.end_from_trigger else ShortEvent(payload)
            return

    def _end_event(self, event: dict[str, Any]) -> TriggerEvent:
        """End the task here, saying in its log what ``execute_complete`` would have said."""
        for level, line in rank_end_lines(event):
            getattr(self.log, level)("%s", line)
        summary = rank_summary(event)
        if event["state"] == SUCCEEDED:
            # sky_rank alone (no return_value copy): the triggerer writes each XCom of each of N rank
            # tasks one by one, in its main loop
            return TaskSuccessEvent(xcoms={"sky_rank": summary})
        return TaskFailedEvent(xcoms={"sky_rank": summary})


class ShortEvent(TriggerEvent):
    """A trigger event Airflow's triggerer logs as one short line ("Trigger fired event ...
    result=TriggerEvent<rank 2: failed>"), not its whole payload as a dict."""

    def __init__(self, payload: Any, **kwargs: Any) -> None:
        super().__init__(payload, **kwargs)

    def __repr__(self) -> str:
        p = self.payload if isinstance(self.payload, dict) else {}
        who = f"rank {p['rank']}" if p.get("kind") == "rank" else str(p.get("kind") or "event")
        return f"TriggerEvent<{who}: {p.get('state', '?')}>"


class SkyGangTrigger(_SkyGangWatchTrigger):
    """Fires on the gang's first failure (after siblings were cancelled) or when every rank succeeded."""

    def __init__(
        self,
        *,
        result: dict[str, Any] | None = None,
        resume_on_success: bool = False,
        rank_task_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        #: how to read the gang's result once every rank succeeded (``result.result_config``), None: no result
        self.result = dict(result) if result else None
        #: a success resumes the task on a worker (it has outlets: only a worker can emit asset events)
        self.resume_on_success = bool(resume_on_success)
        #: the mapped task watching each rank: its states are looked at (see ``triggers.task_states``)
        self.rank_task_id = rank_task_id

    def _task_label(self, ti: Any) -> str:
        return f"gang sensor task {ti.task_id}" if ti is not None else "the gang sensor task"

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs = self._common_kwargs()
        if self.result is not None:
            kwargs["result"] = self.result
        if self.resume_on_success:
            kwargs["resume_on_success"] = True
        if self.rank_task_id:
            kwargs["rank_task_id"] = self.rank_task_id
        return f"{type(self).__module__}.{type(self).__qualname__}", kwargs

    async def _look_at_rank_tasks(self, status: GangStatus, suspects: dict[int, str]) -> dict[int, str]:
        """Cancel the gang if a user marked a rank task failed or success while no triggerer ran its
        trigger (nothing else tells the gang then). Acts on what two looks ``LOOK_EVERY`` apart both
        show, while nobody cancels the gang: a rank task that ended with its rank has its state written
        a moment after the poll that showed the end, and a rank task whose trigger a triggerer ran has
        its ``on_kill`` cancel the gang within that time, saying so. Returns what this look found (the
        next one's suspects)."""
        ti = self.task_instance
        running = [r.rank for r in status.ranks if not r.terminal]
        if ti is None or not self.rank_task_id or not running or status.cancel_requested:
            return {}
        acted = await task_states.acted_on(ti, self.rank_task_id, running)
        if not acted:
            return {}
        confirmed = {r: st for r, st in acted.items() if suspects.get(r) == st}
        if not confirmed:
            return acted
        reason = task_states.acted_reason(ti, self.rank_task_id, confirmed)
        self.log.info("Cancelling every rank of job %s: %s", self.job_id, reason)
        client = await SkyHook(self.sky_conn_id).aclient(self.cluster)
        try:
            await stop_gang(client, self.job_id, self.watch.retry.attempts, self.grace, reason)
        finally:
            client.close()
        return {}

    async def filter_shared_stream(self, shared_stream: AsyncIterator[Any]) -> AsyncIterator[TriggerEvent]:
        failed_before = False
        extra: dict[str, Any] = {}  # the result, once every rank succeeded
        look_at = 0.0  # the rank tasks' states: at the first poll, then every LOOK_EVERY s
        suspects: dict[int, str] = {}
        async for poll, _client in shared_stream:
            if time.monotonic() >= look_at and not poll.status.done:
                look_at = time.monotonic() + task_states.LOOK_EVERY
                suspects = await self._look_at_rank_tasks(poll.status, suspects)
            if not poll.final and poll.max_attempts > 1:
                continue  # the gang may still be retried: only its final outcome counts
            status: GangStatus = poll.status
            if status.failed and not status.done and not failed_before:
                # siblings are being cancelled; the next poll (taken at once) shows them cancelled
                failed_before = True
                continue
            if status.failed or poll.error:
                state, message = FAILED.value, poll.message()
            elif status.succeeded:
                state, message = (
                    SUCCEEDED.value,
                    f"Job {status.job_id}: all {len(status.ranks)} ranks succeeded"
                    + (f" on attempt {poll.attempt}/{poll.max_attempts}" if poll.attempt > 1 else ""),
                )
                if self.result is not None:
                    try:
                        extra["result"] = await read_result(_client, status, self.result)
                    except ResultError as exc:
                        state, message = FAILED.value, f"Job {status.job_id}: {exc}"
            elif status.done and any(r.state == CANCELLED for r in status.ranks):
                state, message = CANCELLED.value, cancel_text(poll)
            else:
                continue
            await self._hold()
            payload = {"kind": "gang", "state": state, "message": message, "gang": status.to_dict()}
            if state == SUCCEEDED.value:
                payload.update(extra)
            ending = self.end_from_trigger and not (state == SUCCEEDED.value and self.resume_on_success)
            yield self._end_event(payload) if ending else ShortEvent(payload)
            return

    def _end_event(self, event: dict[str, Any]) -> TriggerEvent:
        """End the sensor task here, saying in its log what ``execute_complete`` would have said."""
        for line in gang_outcome(event):
            self.log.info("%s", line)
        if event["state"] == SUCCEEDED:
            # the result is the task's return value: what its XComArg (``sky_gang(...).result``) resolves to
            return TaskSuccessEvent(xcoms={"return_value": event["result"]} if "result" in event else None)
        self.log.error("%s", event["message"])
        return TaskFailedEvent()
