"""Wait, without blocking the event loop, for room in the triggerer's log channel.

In Airflow's triggerer every trigger's log line is a synchronous write, from the event loop, to a
socket its supervisor process drains. When the supervisor is busy sending the trigger runner a big
message (the workloads of new triggers, a serialized DAG each, while a wide gang starts), it drains
neither: a write to a full channel then blocks the loop, the loop no longer reads the message, and
both processes wait for each other for good. A 1,024-rank gang failing while its last rank triggers
were still being created did that (py-spy: the runner in a log write, the supervisor in ``send_msg``).
So a rank trigger writes its lines only when the channel has room, and awaits meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import select
import stat
import time
from typing import Any

#: a channel nobody drains for this long belongs to a triggerer stuck for other reasons: write anyway
MAX_WAIT = 60.0


#: the log output last looked at, and its descriptor if it is a socket
_known: list[Any] = [None, None]


def channel_fd() -> int | None:
    """The descriptor this process's log lines are written to, if it is a socket (the triggerer's
    log channel); ``None`` elsewhere (a terminal, a file, ``dag.test()``) or if logging is not Airflow's."""
    import structlog

    out = getattr(structlog.get_config().get("logger_factory"), "io", None)
    if out is not _known[0]:
        _known[:] = [out, _socket_fd(out)]
    return _known[1]


def _socket_fd(out: Any) -> int | None:
    try:
        fd = out.fileno() if out is not None else -1
        return fd if fd >= 0 and stat.S_ISSOCK(os.fstat(fd).st_mode) else None
    except (OSError, ValueError, AttributeError):
        return None


def has_room(fd: int) -> bool:
    """Whether a write of a few lines to ``fd`` would not block: a Unix socket polls writable while
    less than a fourth of its send buffer (~200 KB) waits to be read."""
    poller = select.poll()  # not select(): a triggerer may hold descriptors past FD_SETSIZE
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(0))


async def log_room(max_wait: float = MAX_WAIT) -> None:
    """Return once the log channel (if any) has room, sleeping meanwhile so the loop goes on."""
    fd = channel_fd()
    if fd is None or has_room(fd):
        return
    deadline, delay = time.monotonic() + max_wait, 0.005
    while time.monotonic() < deadline:
        await asyncio.sleep(delay)
        if has_room(fd):
            return
        delay = min(delay * 2, 0.1)
