"""Verifiable resume (issue 8, P3 extension; SPEC P2, P3).

Opt-in with the Coda extension ``stream_verify: true``. Every delta then carries, per choice,

    "coda": {"offset": <bytes of the output before this delta>,
             "length": <bytes in this delta>,
             "digest": "<sha256 hex of the output's bytes through this delta>"}

so a client can check that what it holds is a prefix of the output. A resume names what it
holds: ``GET /v1/streams/{id}?offset=N&digest=HEX`` (n > 1: comma-separated, one per choice;
``digest`` optional). The server replays from the delta boundary at that byte offset; an offset
that is not a delta boundary, a digest that differs from the output's bytes up to it, or an
offset that disagrees with ``Last-Event-ID`` is a 409, never a silent splice.

Offsets count UTF-8 bytes of the returned text (deltas end on character boundaries, K3).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from coda.reader import replay
from coda.server.http_errors import ApiError
from coda.stream import EventType, RequestStream, StreamEvent

C = TypeVar("C", int, tuple[list[int], int])  # NOTE: a Responses seq, a /v1/streams id


def agree_cursor(query: C | None, header: C | None, query_name: str,
                 ahead: Callable[[C, C], bool]) -> tuple[C | None, str]:
    """The resume cursor of a request that names it twice — in the query (``starting_after``,
    ``after``) and as ``Last-Event-ID`` — and the name its later errors cite (P3). One of them
    alone, or both equal: that value. A header ahead of the query is a browser ``EventSource``
    reconnecting to the URL it was opened with (it sends the last id it received): the header
    wins, so nothing the client holds is sent twice. A header behind the query contradicts it:
    a 400 naming both, never a silent pick of either."""
    if query is None:
        return header, "Last-Event-ID"
    if header is None or header == query:
        return query, query_name
    if ahead(header, query):
        return header, "Last-Event-ID"
    raise ApiError(400, f"Last-Event-ID and {query_name} name different resume points (the "
                        f"header is behind the query): send one, or both equal",
                   param=query_name, code="resume_conflict")


def _hash_through(stream: RequestStream, seq: int) -> tuple[int, Any]:
    """(bytes, running sha256) of ``stream``'s deltas with sequence number <= ``seq``."""
    h = hashlib.sha256()
    n = 0
    for ev in replay(stream):
        if ev.seq > seq:
            break
        if ev.type is EventType.DELTA:
            h.update(ev.data)
            n += len(ev.data)
    return n, h


class DeltaIntegrity:
    """Running offset and digest of each choice, starting after the resume positions.

    ``take`` adds a delta's bytes; ``stamp_pending`` reports every byte taken since the last
    report (issue 20 D5: with tools, a delta whose bytes are held back or moved into a call
    produces no frame of its own, so the next frame's stamp covers it too)."""

    def __init__(self, streams: Sequence[RequestStream], after: Sequence[int]) -> None:
        state = [_hash_through(s, a) for s, a in zip(streams, after, strict=True)]
        self._offsets = [n for n, _ in state]
        self._stamped = list(self._offsets)  # NOTE: bytes already covered by a stamp
        self._hashes = [h for _, h in state]

    def unstamp(self, index: int, nbytes: int) -> None:
        """The last ``nbytes`` before the resume point were never covered by a stamp (deltas
        that rendered no frame of their own): the next stamp covers them (issue 20 D5, P3)."""
        self._stamped[index] -= nbytes

    def take(self, index: int, ev: StreamEvent) -> None:
        """Add delta ``ev`` of choice ``index`` (call once per delta, in order)."""
        self._hashes[index].update(ev.data)
        self._offsets[index] += len(ev.data)

    def stamp_pending(self, index: int) -> dict[str, Any] | None:
        """The ``coda`` object covering the bytes taken since the last stamp (None: none)."""
        start, end = self._stamped[index], self._offsets[index]
        if end == start:
            return None
        self._stamped[index] = end
        return {"offset": start, "length": end - start,
                "digest": self._hashes[index].hexdigest()}

    def stamp(self, index: int, ev: StreamEvent) -> dict[str, Any]:
        """The ``coda`` object of delta ``ev`` of choice ``index`` (call once per delta, in
        order)."""
        self.take(index, ev)
        return self.stamp_pending(index) or {"offset": self._offsets[index], "length": 0,
                                             "digest": self._hashes[index].hexdigest()}


def _split(raw: str, n: int, name: str) -> list[str]:
    parts = [p.strip() for p in raw.split(",")]
    if len(parts) != n or not all(parts):
        raise ApiError(400, f"{name} must be {n} comma-separated values", param=name)
    return parts


def resolve_resume(streams: Sequence[RequestStream], positions: list[int] | None,
                   offset: str | None, digest: str | None) -> list[int] | None:
    """The positions to replay after, checked against what the client says it holds.

    ``positions`` come from ``Last-Event-ID`` (None: not given). Returns them unchanged when
    no ``offset`` is named; raises 400 for malformed values and 409 for any mismatch."""
    if offset is None:
        if digest is not None:
            raise ApiError(400, "digest needs offset", param="digest")
        return positions
    n = len(streams)
    parts = _split(offset, n, "offset")
    if not all(p.isascii() and p.isdigit() for p in parts):  # NOTE: never int()'s "1_0", "-1"
        raise ApiError(400, "offset must be byte counts (integers >= 0)", param="offset")
    offsets = [int(p) for p in parts]
    digests = _split(digest, n, "digest") if digest is not None else [None] * n
    resolved: list[int] = []
    for i, (stream, want) in enumerate(zip(streams, offsets, strict=True)):
        seq, h = _boundary(stream, want)
        if seq is None:
            raise ApiError(409, f"offset {want} of choice {i} {_off_boundary(stream, want)}",
                           param="offset", code="resume_mismatch")
        if positions is not None and _hash_through(stream, positions[i])[0] != want:
            raise ApiError(409, f"offset {want} of choice {i} disagrees with Last-Event-ID",
                           param="offset", code="resume_mismatch")
        expected = digests[i]
        if expected is not None and h.hexdigest() != expected.lower():
            raise ApiError(409, f"digest of choice {i} does not match the output's first "
                                f"{want} bytes", param="digest", code="resume_mismatch")
        resolved.append(seq if positions is None else positions[i])
    return resolved


def _boundary(stream: RequestStream, offset: int) -> tuple[int | None, Any]:
    """The sequence number after which exactly ``offset`` output bytes were sent (the last
    such event; None if no boundary) and the digest of those bytes."""
    h = hashlib.sha256()
    n = 0
    found: int | None = None
    for ev in replay(stream):
        if ev.type is EventType.DELTA:
            if n + len(ev.data) > offset:
                break
            h.update(ev.data)
            n += len(ev.data)
        if n == offset and ev.type is not EventType.TERMINAL:
            found = ev.seq  # NOTE: never after the terminal: its frames must be replayed
    return found, h


def _off_boundary(stream: RequestStream, offset: int) -> str:
    """Why ``offset`` (no boundary) cannot be resumed from: the delta boundaries either side
    of it, or the output's length when it is past the end (the 409's words)."""
    below, above, total = 0, None, 0
    for ev in replay(stream):
        if ev.type is EventType.DELTA:
            total += len(ev.data)
            if total <= offset:
                below = total
            elif above is None:
                above = total
    if above is None:
        return f"is past the end of the output ({total} bytes so far)"
    return (f"is inside a delta: the nearest delta boundaries are {below} and {above} (the "
            f"output has {total} bytes so far)")
