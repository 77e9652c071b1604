"""Stop strings up to a tool call's opening tag: the tag window of the string match (issue 13,
issue 20 D2; SPEC S2, S3, G1).

A request with tools names the tag that opens a call (``OutputSpec.stops_end_at``): stop
strings are matched only in the free text before its first occurrence, and from there the
grammar alone ends the output, so a stop string never cuts a constrained call. Bytes that could
still be the start of the tag wait (``_tag_tail``), neither matched nor sent, until the tag
completes (stop strings and stop ids are then off, recorded as a ``stop.state`` row with
``stops_off``) or cannot (a byte that breaks it, or the drain: then they are matched as the
free text they are).

Called by :meth:`coda.output.OutputProcessor._match` only when the request names a tag: a
request without tools never runs this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coda import trace as tr
from coda.stops import StopHit

if TYPE_CHECKING:
    from coda.output import OutputProcessor


def match(p: OutputProcessor, tag: bytes, new: bytes) -> StopHit | None:
    """Push ``new`` through the string matcher up to ``tag``, holding a possible tag start;
    the stop hit in the free text, if any."""
    window = p._tag_tail + new
    at = window.find(tag)
    if at >= 0:
        p._tag_tail = b""
        hit = p.stops.push(window[:at], p._armed)[1] if at else None
        if hit is None:
            p.stops.flush()
            p._stops_off = True
            p.token_stops = None  # NOTE: stop ids no longer apply inside a call either
            if p._tracing:
                p._record(tr.STOP_STATE, held=0, detok_pending=len(p.detok.pending),
                          stops_off=True)
        return hit
    keep = 0 if p._draining else _tag_start_len(window, tag)
    free, p._tag_tail = window[:len(window) - keep], window[len(window) - keep:]
    return p.stops.push(free, p._armed)[1] if free else None


def _tag_start_len(data: bytes, tag: bytes) -> int:
    """Length of the longest suffix of ``data`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(data)), 0, -1):
        if data.endswith(tag[:n]):
            return n
    return 0
