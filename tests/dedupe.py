"""A client-side merge of replayed events, for resume tests (SPEC P3)."""

from __future__ import annotations

from coda.stream import StreamEvent


class Deduper:
    """Client-side merge of possibly replayed events: keeps each (request_id, seq) once and
    yields them in sequence order (P3)."""

    def __init__(self) -> None:
        self._next: dict[str, int] = {}
        self._pending: dict[str, dict[int, StreamEvent]] = {}

    def push(self, event: StreamEvent) -> list[StreamEvent]:
        rid = event.request_id
        nxt = self._next.setdefault(rid, 0)
        if event.seq < nxt:
            return []
        pend = self._pending.setdefault(rid, {})
        pend[event.seq] = event
        out: list[StreamEvent] = []
        while nxt in pend:
            out.append(pend.pop(nxt))
            nxt += 1
        self._next[rid] = nxt
        return out
