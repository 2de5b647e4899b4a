"""Rank output as log lines, no I/O: bounded lines, masked secrets.

Ranks may print anything (binary, one 200 MB line). Whoever shows their output cuts it into lines
here, so a watcher never holds more than about ``LINE_LIMIT`` bytes of an unfinished line and never
reads more than ``READ_CHUNK`` bytes at once, whatever comes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime, timezone

#: a line longer than this many bytes is shown in pieces; every piece but the last ends with LINE_MARKER
LINE_LIMIT = 64 * 1024
LINE_MARKER = " [line continues]"
#: bytes read per remote call when catching up on a log (the rest of an ended rank, a late gap)
READ_CHUNK = 1024 * 1024


#: how much of a failed node's log an error message quotes: its last lines, each cut to its end
TAIL_LINES = 20
TAIL_LINE_CHARS = 1000


def _unmasked(text: str) -> str:
    return text


def tail_text(lines: Iterable[str]) -> str:
    """The last lines of a log for an error message; ``(no output)`` when there were none."""
    shown = [
        line if len(line) <= TAIL_LINE_CHARS else "[...] " + line[-TAIL_LINE_CHARS:]
        for line in list(lines)[-TAIL_LINES:]
    ]
    return "\n".join(shown) if shown else "(no output)"


class LineSplitter:
    """Cut a byte stream into text lines; an over-long line is cut every ``limit`` bytes, with a marker.

    Cuts fall on UTF-8 character boundaries, so a piece never shows half a character. Each line goes
    through ``mask``. Secrets need no care here: the nodes mask them before output reaches the log.
    """

    def __init__(
        self, mask: Callable[[str], str] = _unmasked, limit: int = LINE_LIMIT, offset: int = 0
    ) -> None:
        self.mask = mask
        self.limit = max(1, int(limit))
        self._pending = bytearray()
        #: the log offset of the next piece's first byte (``offset``: where the first ``feed`` starts)
        self._start = int(offset)

    def feed(self, data: bytes) -> Iterator[str]:
        """The lines ``data`` completes (and pieces of over-long ones); the rest waits for more.

        Lazily, one ``limit``-sized slice of ``data`` at a time, so a read of many short lines never
        becomes one list of them all; consume it all before the next call.
        """
        for _, text in self.feed_at(data):
            yield text

    def feed_at(self, data: bytes) -> Iterator[tuple[int, str]]:
        """As :meth:`feed`, each line with the log offset of its first byte (to look up when it was
        printed, :class:`LineClock`)."""
        for start in range(0, len(data), self.limit):
            yield from self._feed(data[start : start + self.limit])

    def _feed(self, data: bytes) -> list[tuple[int, str]]:
        out: list[tuple[int, str]] = []
        parts = data.split(b"\n")
        last = len(parts) - 1
        for i, part in enumerate(parts):
            if not self._pending and len(part) <= self.limit:  # the common case, kept fast
                if i < last:
                    out.append(self._text(part, False, 1))
                else:
                    self._pending += part
                continue
            self._pending += part
            self._cut(out)
            if i < last:
                out.append(self._text(bytes(self._pending), False, 1))
                self._pending.clear()
        return out

    def flush(self) -> list[str]:
        """The unfinished last line, if any (the stream is over)."""
        return [text for _, text in self.flush_at()]

    def flush_at(self) -> list[tuple[int, str]]:
        """As :meth:`flush`, with the line's log offset."""
        if not self._pending:
            return []
        out: list[tuple[int, str]] = []
        self._cut(out)
        out.append(self._text(bytes(self._pending), False, 0))
        self._pending.clear()
        return out

    def _cut(self, out: list[tuple[int, str]]) -> None:
        """Move whole pieces of an over-long pending line to ``out``."""
        buf = self._pending
        while len(buf) > self.limit:
            cut = back = self.limit
            while back > max(0, self.limit - 3) and 0x80 <= buf[back] < 0xC0:
                back -= 1  # a UTF-8 continuation byte: cut before its character instead
            if back > 0 and not 0x80 <= buf[back] < 0xC0:
                cut = back
            out.append(self._text(bytes(buf[:cut]), True, 0))
            del buf[:cut]

    def _text(self, line: bytes, continues: bool, newline: int) -> tuple[int, str]:
        start = self._start
        self._start += len(line) + newline
        text = line.decode("utf-8", "replace")
        if self.mask is not _unmasked:
            text = self.mask(text)
        return start, (text + LINE_MARKER if continues else text)


class LineClock:
    """When each byte of a rank's log was first seen on its node: ``(size, time)`` records, a record
    saying the log held ``size`` bytes at ``time`` (the watcher's clock, see ``runtime.STATUS_SCRIPT``).

    A line was printed before the first record whose size passed its first byte: that record's time
    is the line's, to within a poll interval, however late the line is read. Records may come out of
    order (two watchers); the earliest time that covers an offset wins.
    """

    def __init__(self) -> None:
        self._sizes: list[int] = []
        self._times: list[float] = []

    def add(self, size: int, at: float) -> None:
        """``size`` bytes were in the log at ``at``."""
        i = bisect.bisect_left(self._sizes, size)
        if i < len(self._sizes) and self._sizes[i] == size:
            self._times[i] = min(self._times[i], at)
        else:
            self._sizes.insert(i, size)
            self._times.insert(i, at)
        # a bigger size seen earlier also dates every smaller offset: keep the times non-decreasing
        if i + 1 < len(self._times) and self._times[i] > self._times[i + 1]:
            self._times[i] = self._times[i + 1]
        for j in range(i - 1, -1, -1):
            if self._times[j] <= self._times[j + 1]:
                break
            self._times[j] = self._times[j + 1]

    def time_of(self, offset: int) -> float | None:
        """When the byte at ``offset`` was first seen, None when no record covers it yet."""
        i = bisect.bisect_right(self._sizes, offset)
        return self._times[i] if i < len(self._times) else None

    def forget_before(self, offset: int) -> None:
        """Drop records no line from ``offset`` on needs (they only date earlier bytes)."""
        i = bisect.bisect_right(self._sizes, offset)
        del self._sizes[:i], self._times[:i]


def iso_time(at: float) -> str:
    """``at`` as the log record timestamp Airflow's structlog writes (ISO 8601, UTC, ``Z``)."""
    return datetime.fromtimestamp(at, tz=timezone.utc).isoformat().replace("+00:00", "Z")


def parse_times(text: str) -> list[tuple[int, float]]:
    """The ``size time`` lines of a rank's ``times`` file (``runtime.TIMES_SCRIPT``); bad lines skipped."""
    out: list[tuple[int, float]] = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out.append((int(parts[0]), float(parts[1])))
            except ValueError:
                continue
    return out
