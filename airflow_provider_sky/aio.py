"""Running coroutines from sync code and fanning calls out, always bounded: nothing waits forever.

``run_sync`` owns its event loop (a hung call's leftovers are cancelled and abandoned after a bound,
never awaited at interpreter exit); ``fan_out`` runs one call per item with a concurrency limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import (
    Awaitable,
    Callable,
    Coroutine,
    Iterable,
)
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


FANOUT_LIMIT = 64


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync code, also when the caller already runs an event loop.

    The coroutine runs on a loop of our own whose shutdown is bounded (:func:`_run_owned`):
    ``asyncio.run`` waits without limit for leftover tasks to end, and a status call that never
    answered once hung a rank task there for good. From inside a running loop it runs in a
    thread of its own, joined once the result is in (a daemon thread, so a stuck one never holds
    the interpreter at exit).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run_owned(coro)
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(_run_owned(coro))
        except BaseException as exc:  # handed to the caller as is
            done.set_exception(exc)

    thread = threading.Thread(target=run, name="sky-run-sync", daemon=True)
    thread.start()
    try:
        return done.result()
    finally:
        # the thread only has to return now: join it so none is left running when we return
        thread.join(THREAD_END_WAIT)


def _run_owned(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on a new loop, then cancel what it left running and close the loop, bounded.

    Leftover tasks get :data:`CLEANUP_TIMEOUT` to end after their cancel (ours kill and reap their
    processes well within it); one that does not is logged and dropped. The loop's default executor
    is ours too, shut down without joining a thread that may be stuck.
    """
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(thread_name_prefix="sky-run-sync-io")
    loop.set_default_executor(executor)
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            _cancel_leftovers(loop)
            loop.run_until_complete(_bounded_wait(loop.shutdown_asyncgens(), "async generators"))
        finally:
            executor.shutdown(wait=False, cancel_futures=True)
            asyncio.set_event_loop(None)
            loop.close()


#: seconds ``run_sync`` waits for its thread to end once the coroutine's result is in
THREAD_END_WAIT = 1.0

#: seconds ``run_sync`` gives leftover tasks (and async generators) to end once cancelled
CLEANUP_TIMEOUT = 5.0


async def _bounded_wait(aw: Awaitable[Any], what: str) -> None:
    try:
        await asyncio.wait_for(aw, CLEANUP_TIMEOUT)
    except asyncio.TimeoutError:
        log.warning("Closing %s took over %ss; left behind", what, CLEANUP_TIMEOUT)


def _cancel_leftovers(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel the tasks ``loop`` still has and wait for them, at most :data:`CLEANUP_TIMEOUT`."""
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.wait(tasks, timeout=CLEANUP_TIMEOUT))
    stuck = [t for t in tasks if not t.done()]
    if stuck:
        log.warning(
            "%d task(s) did not end within %ss of their cancel; left behind: %s",
            len(stuck),
            CLEANUP_TIMEOUT,
            stuck,
        )
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.debug("A leftover task failed: %r", task.exception())


async def fan_out(
    fn: Callable[[T], Awaitable[R]], items: Iterable[T], limit: int = FANOUT_LIMIT
) -> list[R | BaseException]:
    """Call ``fn`` on every item concurrently, at most ``limit`` at once; exceptions are returned."""
    sem = asyncio.Semaphore(limit)

    async def one(item: T) -> R:
        async with sem:
            return await fn(item)

    return await asyncio.gather(*(one(i) for i in items), return_exceptions=True)


#: seconds to wait for an abandoned call to end once cancelled (runners kill their script within it)
CANCEL_WAIT = 1.0


async def cancel_bounded(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel the unfinished ``tasks`` and wait for them, at most :data:`CANCEL_WAIT`; log the rest."""
    left = [t for t in tasks if not t.done()]
    for task in left:
        task.cancel()
    if not left:
        return
    _, stuck = await asyncio.wait(left, timeout=CANCEL_WAIT)
    if stuck:
        log.warning("%d call(s) still ending %ss after their cancel", len(stuck), CANCEL_WAIT)
