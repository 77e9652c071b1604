"""Stop strings on the visible byte stream, the hit and the tie rule (SPEC S1–S4, G2).

Pure bookkeeping (no torch, no text decoding), in three modules, one concept each:

* :class:`StopStringMatcher` (here) — stop byte/string sequences on the incrementally
  detokenized byte stream (S1). It holds back exactly the longest suffix of the output that is
  still a prefix of some stop string (S2); the first hit is absorbing (S3); simultaneous matches
  are resolved by the versioned tie rule (S4). Here too: the hit record (:class:`StopHit`), the
  tie rule's version and a stop string's one validation (:func:`stop_bytes`).
* :class:`coda.stops_ids.StopTokenMatcher` — stop token-id sequences on the id stream (S1),
  same tie rule.
* :mod:`coda.stops_automaton` — the Aho–Corasick automata both run, compiled once per stop set
  (the byte automaton's state depth is the held-back length).

Tie rule (S4, ``STOP_RULE_VERSION`` "2"): earliest end wins, then the longest stop, then the
lowest configuration index. Across the two kinds (:mod:`coda.output`) the end is counted in
selected tokens, and an id sequence ending at the same token as a stop string wins (ids are
checked first, G1). Version "1" let ids held for a possible id sequence hide their text from
the string matcher, so a stop string inside them ended late (issue 8). Earliest end is automatic because matching stops at the first byte
(token) where any stop ends; every stop ending there is a suffix of the state's string, so the
longest one is the state itself or the first terminal on its failure chain, precomputed per state.

Offsets (S3 bookkeeping, O1 trace)::

    stream  | ... emitted or dropped ... | held | new push data ...... |
    offset  0          emitted + dropped ^                           ^ consumed_bytes
    hit     start = end - len(stop); end = offset just after the stop's last byte
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from coda.errors import InvalidRequestError
from coda.stops_automaton import ByteAutomaton, compile_bytes

STOP_RULE_VERSION: str = "2"
"""S4 tie rule: earliest end (selected tokens across kinds, then bytes) -> id sequence before
string at the same token -> longest -> configuration order. Bump if the rule changes."""


def stop_bytes(stop: object, field: str = "stop") -> bytes:
    """The UTF-8 bytes a stop string is matched as (S1). One home for its validation: an empty
    or non-string stop, or one that has no UTF-8 form (a lone surrogate such as ``"\\ud800"``,
    which JSON can carry), is an InvalidRequestError naming ``field``, never a UnicodeError."""
    if not isinstance(stop, str) or not stop:
        raise InvalidRequestError(f"{field}: stop strings must be non-empty strings", field=field)
    try:
        return stop.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(
            f"{field}: a stop string must be valid Unicode text (no lone surrogates)",
            field=field) from None


class StopMatcherClosed(RuntimeError):
    """Output was pushed after the matcher ended (hit, flush or discard): a loop bug (S3)."""


@dataclass(frozen=True)
class StopHit:
    """The first stop match of a request (S3), chosen by the S4 tie rule.

    ``kind="string"``: ``start``/``end`` are byte offsets in the whole visible output stream,
    half-open (``end`` is just after the stop's last byte).
    ``kind="token_ids"``: ``start`` is the index of the first matched token in the pushed id
    stream and ``end`` the index just after the last one (half-open, same convention).
    """

    kind: Literal["string", "token_ids"]
    index: int
    stop: str | tuple[int, ...]
    start: int
    end: int

    def as_dict(self) -> dict[str, object]:
        """JSON-ready form for the trace (O1)."""
        stop: object = self.stop if isinstance(self.stop, str) else list(self.stop)
        return {"kind": self.kind, "index": self.index, "stop": stop,
                "start": self.start, "end": self.end, "rule_version": STOP_RULE_VERSION}



class StopStringMatcher:
    """Streaming stop-string matcher over the visible byte stream (S1–S4, G2).

    Contract: feed every visible byte (including what the detokenizer's ``finish()`` drains, G2)
    through :meth:`push`, send only what it returns. After a hit, call :meth:`discard` (never
    :meth:`flush`); at any other normal end call :meth:`flush`; on cancel call :meth:`discard`.
    The matcher then accepts no more output. Stops are matched as UTF-8 bytes; since a valid stop
    starts with a lead byte, the held suffix of valid UTF-8 output starts on a character boundary.

    Accounting, always: ``consumed == emitted_bytes + dropped_bytes + len(held)``.
    """

    def __init__(self, stops: Sequence[str], *, include_stop_in_output: bool = False) -> None:
        encoded = tuple(stop_bytes(s) for s in stops)
        self._stops = tuple(stops)
        self._include = include_stop_in_output
        auto = compile_bytes(encoded) if stops else None
        self._auto = auto
        # NOTE: the root fast path calls _search first; with no stops it is {}.get (always None,
        # C speed), and closing swaps in _raise_closed, so push() needs no separate flag test.
        self._search: Callable[[bytes], re.Match[bytes] | None] = (
            auto.start_search if auto is not None else _NO_MATCH.get)
        self._state = 0
        self._held = b""
        self._emitted = 0
        self._dropped = 0
        self._hit: StopHit | None = None
        self._tail_after_hit = b""
        self._closed = False

    @property
    def held(self) -> bytes:
        """Bytes held back (S2): the longest output suffix that is a prefix of some stop."""
        return self._held

    @property
    def hit(self) -> StopHit | None:
        return self._hit

    @property
    def emitted_bytes(self) -> int:
        """Bytes returned as safe so far by push/flush (the stop itself only if included)."""
        return self._emitted

    @property
    def dropped_bytes(self) -> int:
        """Bytes removed from the stream: the stop (unless included), what followed it, discards."""
        return self._dropped

    @property
    def consumed_bytes(self) -> int:
        """All bytes pushed so far (the stream offset of the next byte)."""
        return self._emitted + self._dropped + len(self._held)

    @property
    def tail_after_hit(self) -> bytes:
        """Bytes of the hitting push that came after the stop: dropped, recorded for K2."""
        return self._tail_after_hit

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, data: bytes, armed: bool = True) -> tuple[bytes, StopHit | None]:
        """Consume visible bytes; return ``(safe_bytes, hit)``. Raises StopMatcherClosed after end.

        ``armed=False`` (before ``min_tokens``, issue 20 D6): a stop completing in ``data`` is
        ordinary text and matching goes on past it; what may still begin a stop stays held."""
        s0 = s = self._state
        pos = 0
        if s == 0:
            m = self._search(data)
            if m is None:  # fast path: no byte here can begin a stop
                self._emitted += len(data)
                return data, None
            pos = m.start()
        auto = self._auto
        assert auto is not None  # NOTE: off-root or a start byte implies a compiled stop set
        n_live = auto.n_live
        if not armed or s >= n_live:
            return self._push_slow(auto, data, armed)
        delta = auto.delta
        for b in data[pos:] if pos else data:
            s = delta[s][b]
            if s >= n_live:
                return self._on_hit(auto, data, s0, pos)
        return self._settle(auto, data, s)

    def _push_slow(self, auto: ByteAutomaton, data: bytes, armed: bool
                   ) -> tuple[bytes, StopHit | None]:
        """Byte by byte through live and hit states (before min_tokens hits are ignored: issue 20
        D6)."""
        s, n_live = self._state, auto.n_live
        for i, b in enumerate(data):
            s = auto.delta[s][b] if s < n_live else auto.hit_delta[s - n_live][b]
            if s >= n_live and armed:
                return self._close_hit(auto, data, i, s)
        return self._settle(auto, data, s)

    def _settle(self, auto: ByteAutomaton, data: bytes, s: int) -> tuple[bytes, None]:
        """No hit in ``data``: state ``s``; hold its longest stop-prefix suffix (S2)."""
        self._state = s
        total = self._held + data if self._held else data
        keep = auto.depth[s] if s < auto.n_live else auto.hit_hold[s - auto.n_live]
        if keep:
            cut = len(total) - keep
            safe, self._held = total[:cut], total[cut:]
        else:
            safe, self._held = total, b""
        self._emitted += len(safe)
        return safe, None

    def _on_hit(self, auto: ByteAutomaton, data: bytes, s0: int, pos: int
                ) -> tuple[bytes, StopHit]:
        """Cold path: re-run from the push's start state to locate the hit, then close (S3)."""
        s, i = s0, pos
        while True:  # NOTE: re-running is cheap and keeps the hot loop free of a counter
            s = auto.delta[s][data[i]]
            if s >= auto.n_live:
                break
            i += 1
        return self._close_hit(auto, data, i, s)

    def _close_hit(self, auto: ByteAutomaton, data: bytes, i: int, s: int
                   ) -> tuple[bytes, StopHit]:
        """The stop of hit state ``s`` ends at ``data[i]``: cut there and close (S3)."""
        k = s - auto.n_live
        length, index = auto.hit_len[k], auto.hit_index[k]
        end = self.consumed_bytes + i + 1
        total = self._held + data[: i + 1]
        safe = total if self._include else total[: len(total) - length]
        self._hit = StopHit("string", index, self._stops[index], end - length, end)
        self._tail_after_hit = data[i + 1:]
        self._emitted += len(safe)
        self._dropped += len(self._held) + len(data) - len(safe)
        self._held = b""
        self._close()
        return safe, self._hit

    def _close(self) -> None:
        self._state = 0
        self._search = _raise_closed
        self._closed = True

    def flush(self) -> bytes:
        """Normal end without a hit: release the held suffix (it matched nothing); close."""
        out, self._held = self._held, b""
        self._emitted += len(out)
        self._close()
        return out

    def discard(self) -> bytes:
        """Cancel, or after a hit (G2): drop the held suffix and return it; close."""
        out, self._held = self._held, b""
        self._dropped += len(out)
        self._close()
        return out

    def snapshot(self) -> dict[str, object]:
        """Matcher state for the request trace (O1)."""
        return {"rule_version": STOP_RULE_VERSION, "state": self._state,
                "depth": len(self._held), "held_hex": self._held.hex(),
                "consumed_bytes": self.consumed_bytes, "emitted_bytes": self._emitted,
                "dropped_bytes": self._dropped, "closed": self._closed,
                "hit": self._hit.as_dict() if self._hit is not None else None}


_NO_MATCH: dict[bytes, re.Match[bytes]] = {}


def _raise_closed(data: bytes) -> re.Match[bytes] | None:
    raise StopMatcherClosed("push() after the stop matcher ended (S3)")
