"""A conforming SSE parser over raw bytes, fed in arbitrary network reads (issue 20 item 4;
SPEC P2, P3, K2).

It follows the WHATWG HTML "event stream interpretation": the byte stream is UTF-8 (decoded
incrementally, so a read that ends inside a character waits for the rest), a leading BOM is
skipped, lines end at CRLF, LF or CR (a CR at the end of a read waits for the next byte), a
line starting with ``:`` is a comment, ``field: value`` loses one leading space of the value,
``data`` lines of one event are joined by ``\\n``, a blank line dispatches, an event with no
data is not dispatched, and the last event id persists across events (``Last-Event-ID``).
One deviation, on purpose: bytes that are not UTF-8 raise instead of becoming U+FFFD, because
the server must never send them.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: ``id`` is the last event id at dispatch (``""`` if none yet)."""

    id: str
    event: str
    data: str


class SSEParser:
    """Incremental parser: ``feed(read)`` returns the events that read completed."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self._text = ""
        self._started = False
        self._data: list[str] = []
        self._event = ""
        self._id_buffer = ""
        self.last_id = ""   # NOTE: set at dispatch: what a reconnecting client sends
        self.comments = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self._text += self._decoder.decode(chunk)
        if not self._started and self._text:
            self._started = True
            if self._text.startswith("\ufeff"):
                self._text = self._text[1:]
        return self._lines(final=False)

    def close(self) -> list[SSEEvent]:
        """End of stream: a trailing CR ends its line; an undispatched event is discarded."""
        self._text += self._decoder.decode(b"", final=True)
        return self._lines(final=True)

    def _lines(self, final: bool) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        text, pos = self._text, 0
        while True:
            cr, lf = text.find("\r", pos), text.find("\n", pos)
            ends = [i for i in (cr, lf) if i >= 0]
            if not ends:
                break
            end = min(ends)
            if text[end] == "\r":
                if end + 1 == len(text) and not final:
                    break  # NOTE: a CR ending this read may be the first half of CRLF
                step = 2 if text.startswith("\r\n", end) else 1
            else:
                step = 1
            ev = self._line(text[pos:end])
            if ev is not None:
                out.append(ev)
            pos = end + step
        self._text = text[pos:]
        return out

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            self.comments += 1
            return None
        field, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        elif field == "id" and "\0" not in value:
            self._id_buffer = value
        return None

    def _dispatch(self) -> SSEEvent | None:
        data, event = self._data, self._event
        self._data, self._event = [], ""
        self.last_id = self._id_buffer
        if not data:
            return None
        return SSEEvent(self.last_id, event or "message", "\n".join(data))


def parse_chunks(chunks: list[bytes]) -> tuple[list[SSEEvent], str]:
    """Every event of ``chunks`` read in order, and the last event id at the end."""
    parser = SSEParser()
    events = [ev for c in chunks for ev in parser.feed(c)]
    events += parser.close()
    return events, parser.last_id


def split_at(raw: bytes, offsets: list[int]) -> list[bytes]:
    """``raw`` cut at the (deduplicated, in-range) byte ``offsets``: the network reads."""
    cuts = sorted({o for o in offsets if 0 < o < len(raw)})
    bounds = [0, *cuts, len(raw)]
    return [raw[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def awkward_offsets(raw: bytes) -> list[int]:
    """Offsets that split something: inside a multi-byte character, inside a ``data:`` /
    ``id:`` / ``event:`` field name, between the CR-free ``\\n\\n`` of a dispatch."""
    out = [i for i, b in enumerate(raw) if 0x80 <= b < 0xC0]
    for tag in (b"data:", b"id:", b"event:", b"\n\n"):
        start = raw.find(tag)
        while start >= 0:
            out += range(start + 1, start + len(tag))
            start = raw.find(tag, start + 1)
    return sorted(set(out))
