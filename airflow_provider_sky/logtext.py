"""Rank output as log lines, no I/O: bounded lines, masked secrets.

Ranks may print anything (binary, one 200 MB line). Whoever shows their output cuts it into lines
here, so a watcher never holds more than about ``LINE_LIMIT`` bytes of an unfinished line and never
reads more than ``READ_CHUNK`` bytes at once, whatever comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

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

    def __init__(self, mask: Callable[[str], str] = _unmasked, limit: int = LINE_LIMIT) -> None:
        self.mask = mask
        self.limit = max(1, int(limit))
        self._pending = bytearray()

    def feed(self, data: bytes) -> Iterator[str]:
        """The lines ``data`` completes (and pieces of over-long ones); the rest waits for more.

        Lazily, one ``limit``-sized slice of ``data`` at a time, so a read of many short lines never
        becomes one list of them all; consume it all before the next call.
        """
        for start in range(0, len(data), self.limit):
            yield from self._feed(data[start : start + self.limit])

    def _feed(self, data: bytes) -> list[str]:
        out: list[str] = []
        parts = data.split(b"\n")
        last = len(parts) - 1
        for i, part in enumerate(parts):
            if not self._pending and len(part) <= self.limit:  # the common case, kept fast
                if i < last:
                    out.append(self._text(part, False))
                else:
                    self._pending += part
                continue
            self._pending += part
            self._cut(out)
            if i < last:
                out.append(self._text(bytes(self._pending), False))
                self._pending.clear()
        return out

    def flush(self) -> list[str]:
        """The unfinished last line, if any (the stream is over)."""
        if not self._pending:
            return []
        out: list[str] = []
        self._cut(out)
        out.append(self._text(bytes(self._pending), False))
        self._pending.clear()
        return out

    def _cut(self, out: list[str]) -> None:
        """Move whole pieces of an over-long pending line to ``out``."""
        buf = self._pending
        while len(buf) > self.limit:
            cut = back = self.limit
            while back > max(0, self.limit - 3) and 0x80 <= buf[back] < 0xC0:
                back -= 1  # a UTF-8 continuation byte: cut before its character instead
            if back > 0 and not 0x80 <= buf[back] < 0xC0:
                cut = back
            out.append(self._text(bytes(buf[:cut]), True))
            del buf[:cut]

    def _text(self, line: bytes, continues: bool) -> str:
        text = line.decode("utf-8", "replace")
        if self.mask is not _unmasked:
            text = self.mask(text)
        return text + LINE_MARKER if continues else text
