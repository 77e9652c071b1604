"""What one request's deltas carry: bytes released from the unsent stream, each with the
tokens whose last byte it sends, and the returned-token count (SPEC K2, L6, S3, P1, P5;
issue 20 D9; seed 000 §4.3).

:class:`DeltaAssembly` is the sending half of :class:`coda.output.OutputProcessor` (its
base): the processor decides *how far* the stream may go (stops, holds, ends), and calls
:meth:`DeltaAssembly._release` with that offset; this half turns the bytes up to it into one
``stream.delta``. Its rules:

- K2: a token goes with the delta that sends its LAST byte (:meth:`_complete`): where it ends
  in the detokenized text is recorded as the detokenizer lets go of its bytes
  (:meth:`_note_detok_end`, :mod:`coda.token_ends`); ids a stop may still own wait (S1).
- S3: at a stop hit the tokens are cut to the text that was sent (:func:`cut_to_text`); the
  rest are the terminal's trailing tokens (:meth:`_report_cut`), never a
  token-only delta (P1: a delta is non-empty text).
- L6: a token counts as returned once the first of its bytes is sent: the detokenized
  output holds whole characters, so a token whose bytes all wait for a later one (a multi-byte
  character split over tokens, an open byte-fallback run) is returned with the output that
  releases them, from that output's start (:meth:`_note_visible`, :meth:`_advance_returned`);
  ``sent_mark`` is the pair a reader on another thread sees.
- P5: ``stop_buffer_s`` is the time some output was held back (:meth:`_track_hold`).
- Issue 20 D9: the first delta states the prefix cache's hit (``cached_prompt_tokens``).

Offsets (stream bytes, one owner token each; stream offsets count answer bytes only, and
``_removed`` reasoning marker bytes precede what is sent next, issue 23)::

    stream  | sent ... | unsent: string-held or owned by held ids | (next push)
            0       sent_off                                  consumed
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import tokenizers

from coda import trace as tr
from coda.detokenizer import IncrementalDetokenizer
from coda.output_spec import OutputSpec
from coda.stream import RequestStream, TokenInfo, shown_bytes
from coda.token_ends import TokenEnds
from coda.trace import TraceHandle, TraceSink

# -- the last delta's tokens at a stop (S3, K2) ---------------------------------------------
# A stop string can end the text inside a token (stop "ragon" after " dragon": the text ends
# " d"), so the tokens the final delta carries may hold bytes the text does not.
# ``cut_to_text`` keeps their bytes up to the text's end: the token the stop cut keeps its part
# before the stop; tokens wholly past it are the stop's own: the terminal's trailing tokens,
# never reported (S3, like EOS). A token goes with the delta that sends its LAST byte
# (coda.output), so where the stop starts inside a token whose first bytes a delta already
# sent, no delta is left for it: it is cut the same way and reported from the terminal
# (``Terminal.trailing_shown``). So the logprob entries reassemble the text, and every
# selected token is still in a delta or the terminal.


def cut_to_text(tokens: Sequence[TokenInfo], budget: int,
                skip_special: bool) -> tuple[TokenInfo, ...]:
    """``tokens`` with their bytes cut to the first ``budget`` bytes (the text left for them).

    A token without bytes (no logprobs asked, or a skipped special token) is kept while no
    token was cut or dropped; from the first token that does not fit, the rest are dropped."""
    out: list[TokenInfo] = []
    left = max(budget, 0)
    for t in tokens:
        n = shown_bytes(t, skip_special)
        if n <= left:
            out.append(t)
            left -= n
            continue
        if left > 0:
            out.append(replace(t, piece=t.piece[:left]))  # NOTE: the token the stop cut
        break  # NOTE: what follows is the stop's own
    return tuple(out)


def cut_tail(tokens: Sequence[TokenInfo], n: int, skip_special: bool) -> tuple[TokenInfo, ...]:
    """``tokens`` without the last ``n`` bytes their pieces add to the text (K2, K3: a partial
    character the budget cut, removed from the text): every token stays (each was selected and
    is billed), the ones wholly in the removed bytes with none."""
    out = list(tokens)
    for i in range(len(out) - 1, -1, -1):
        k = min(n, shown_bytes(out[i], skip_special))
        if k:
            out[i] = replace(out[i], piece=out[i].piece[:len(out[i].piece) - k])
            n -= k
    return tuple(out)


class DeltaAssembly:
    """The unsent stream of one request and the token entries, counts and clocks of what it
    sends (the processor's base; see the module doc)."""

    def __init__(self, request_id: str, tokenizer: tokenizers.Tokenizer, spec: OutputSpec,
                 stream: RequestStream, trace: TraceSink,
                 prompt_token_ids: tuple[int, ...]) -> None:
        self.spec = spec
        self.stream = stream
        # NOTE: rows go through the request's handle, which stamps its id (one from
        # coda.request.RequestRun is kept; a bare sink gets its own)
        self.trace = trace if isinstance(trace, TraceHandle) else TraceHandle(trace, request_id)
        self._tracing = self.trace.enabled
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=spec.skip_special_tokens,
                                            prompt_token_ids=prompt_token_ids)
        self._stream = bytearray()            # bytes pushed but not yet sent (see module doc)
        self._sent_off = 0                    # stream offset of self._stream[0]
        self._pending_tokens: list[TokenInfo] = []  # selected, no delta carried them yet
        # K2: per pending token, the detokenized offset after its last byte (coda.token_ends),
        # None while the detokenizer holds some of its bytes
        self._pending_ends: list[int | None] = []
        self._token_ends = TokenEnds()
        self._shown = 0       # bytes the pieces of the tokens sent so far add to the text (K2)
        self._cutting = False  # a stop hit: the last delta's tokens are cut to the text (S3)
        # last pending tokens that may be a stop's own (an id sequence's held ids; after the
        # cut delta, every token past the cut): never sent, never reported (S1, S3)
        self._own = 0
        self.trailing_shown = 0  # K2: the first trailing tokens are text, cut to it (S3)
        self._eos_token: TokenInfo | None = None
        # L6 accounting: start offsets of visible tokens not yet reached by the stream
        self._visible = 0
        self._unreturned: deque[int] = deque()
        # L6: tokens pushed whose bytes the detokenizer still holds, none out yet (their first
        # byte comes with a later output), and the visible tokens of the last output (its
        # trace row's ``starts``)
        self._waiting = 0
        self._starts = 0
        self.returned_tokens = 0
        self.emitted_bytes = 0
        # NOTE: (emitted_bytes, returned_tokens), set in one assignment after both moved: a
        # consistent pair for a reader on another thread (a worker's billing reports)
        self.sent_mark = (0, 0)
        self.stop_buffer_s = 0.0
        self._held_since: float | None = None
        # L6: prompt tokens the prefix cache held; the driver sets it at the lookup, before any
        # token is selected (0: no prefix cache), and the first delta carries it (issue 20 D9)
        self.cached_prompt_tokens = 0
        self._removed = 0                     # reasoning marker bytes removed (L6: never sent)

    def trailing_tokens(self) -> tuple[TokenInfo, ...]:
        """Selected tokens that no delta carried: held or textless ones, then EOS if chosen."""
        out = tuple(self._pending_tokens) + ((self._eos_token,) if self._eos_token else ())
        self._pending_tokens.clear()
        self._pending_ends.clear()
        return out

    @property
    def detok_bytes(self) -> int:
        """Bytes the detokenizer produced so far."""
        return self._visible

    def _detok_push(self, token_id: int) -> bytes:
        data = self.detok.push(token_id)
        if data:
            self._note_visible(data, self._waiting + 1)
        elif self.detok.held_tokens:
            self._waiting += 1  # NOTE: L6: all its bytes held; its first comes out later
        self._token_ends.output(data)
        self._note_detok_end(self.detok.held_tokens)
        return data

    def _note_detok_end(self, held: int, *, fallback: bool = True) -> None:
        """K2: every token but the last ``held`` has its last byte out of the detokenizer: set
        where it ends in the detokenized bytes (coda.token_ends; ``fallback`` False: a tail
        cut off at the end, whose tokens keep no end)."""
        ends = self._token_ends.release(held, fallback=fallback)
        if ends:
            i = self._pending_ends.index(None)  # NOTE: the unset ones are the last ones
            self._pending_ends[i:i + len(ends)] = ends

    def _note_visible(self, data: bytes, tokens: int) -> None:
        """L6: the detokenizer produced ``data``, which holds the first bytes of ``tokens``
        tokens (the pushed one and the waiting ones whose held bytes it releases): each counts
        as returned once the first byte of ``data`` is sent (:meth:`_send`). Exact where the
        tokens' bytes are the text's (byte-level); a byte-fallback run released as a group
        counts its tokens from the group's start."""
        self._unreturned.extend([self._visible] * tokens)
        self._starts, self._waiting = tokens, 0
        self._visible += len(data)

    def _release(self, upto: int) -> None:
        """Send the unsent stream up to offset ``upto`` (nothing if already sent)."""
        n = upto - self._sent_off
        if n > 0:
            data = bytes(self._stream[:n])
            del self._stream[:n]
            self._sent_off = upto
            self._send(data)
        self._track_hold()

    def _send(self, data: bytes, reasoning: bool = False) -> None:
        if not data:
            return
        # NOTE: the first delta states the prefix-cache lookup's result (issue 20 D9)
        cached = self.cached_prompt_tokens if not self.emitted_bytes else None
        skip = self.spec.skip_special_tokens
        text_end = self.emitted_bytes + len(data) + self._removed
        if self._cutting:
            # NOTE: K2: the tokens' bytes end where the text ends (cut_to_text);
            # the stop's own tokens stay the terminal's trailing ones (never reported, S3)
            budget = self._token_ends.piece_at(text_end, text_end) - self._shown
            kept = cut_to_text(self._pending_tokens, budget, skip)
            tokens, n = kept, len(kept)
            self._own = len(self._pending_tokens) - n  # NOTE: the rest are the stop's own
        else:
            n = self._complete(text_end)
            tokens = tuple(self._pending_tokens[:n])
        self._shown += sum(shown_bytes(t, skip) for t in tokens)
        ev = self.stream.delta(data, tokens, cached, reasoning=reasoning)
        del self._pending_tokens[:n], self._pending_ends[:n]
        self.emitted_bytes += len(data)
        self._advance_returned()
        if self._tracing:
            self._record(tr.STREAM_DELTA, seq=ev.seq, nbytes=len(data),
                         text=data.decode("utf-8", "replace"),
                         **({"reasoning": True} if reasoning else {}))

    def _complete(self, text_end: int) -> int:
        """K2: how many pending tokens (in order) go with a delta after which the client holds
        ``text_end`` bytes: those whose every shown byte it then holds. A token goes with the
        delta that sends its LAST byte, never its first: a stop may still cut it (S2, S3), and
        the entries must not show bytes the text never gets. Ids an id sequence may still own
        wait (S1)."""
        n = 0
        mine = max(len(self._pending_ends) - self._own, 0)
        for end in self._pending_ends[:mine]:
            if end is None or end > text_end:
                break
            n += 1
        self._token_ends.forget_before(text_end)
        return n

    def _report_cut(self) -> None:
        """S3, K2 at a stop hit: the pending tokens before the stop's own (an id sequence's
        ``_own``), cut to the text that was sent (:func:`cut_to_text`), stay
        the first ``trailing_shown`` trailing tokens: a token whose first bytes went out before
        the stop string that starts inside it (``".\n"`` then ``"\n"``, stop ``"\n\n"``)."""
        # NOTE: not a token-only delta: a delta is non-empty text everywhere (P1, the renderers,
        # the durable log, the trace); the terminal's trailing tokens already reach every
        # renderer's final chunk, and every selected token stays in a delta or the terminal
        eligible = self._pending_tokens[:max(len(self._pending_tokens) - self._own, 0)]
        sent = self.emitted_bytes + self._removed
        budget = self._token_ends.piece_at(sent, sent) - self._shown
        kept = cut_to_text(eligible, budget, self.spec.skip_special_tokens)
        self._pending_tokens[:len(kept)] = kept
        self.trailing_shown = len(kept)

    def _report_dropped(self, n: int) -> None:
        """K2, K3 at a budget end: the last ``n`` bytes of the pending tokens were removed (a
        partial character): their entries show only the bytes the text has
        (:func:`cut_tail`), so they still reassemble it."""
        self._pending_tokens[:] = cut_tail(self._pending_tokens, n,
                                           self.spec.skip_special_tokens)

    def _advance_returned(self) -> None:
        """L6: tokens whose first byte the stream reached; removed reasoning markers
        count as reached (issue 23): they precede what is sent next."""
        while self._unreturned and self._unreturned[0] < self.emitted_bytes + self._removed:
            self._unreturned.popleft()
            self.returned_tokens += 1
        self.sent_mark = (self.emitted_bytes, self.returned_tokens)

    def _track_hold(self) -> None:
        """stop_buffer_s (P5): time during which some output was held back for a stop."""
        now = time.monotonic()
        if self._stream and self._held_since is None:
            self._held_since = now
        elif not self._stream:
            self._stop_held_clock(now)

    def _stop_held_clock(self, now: float | None = None) -> None:
        if self._held_since is not None:
            self.stop_buffer_s += (now or time.monotonic()) - self._held_since
            self._held_since = None

    def _record(self, kind: str, **data: Any) -> None:
        self.trace.emit(kind, data)
