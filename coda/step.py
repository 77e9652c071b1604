"""Per-token output processing: the middle of the §4.3 loop, shared by the reference loop and
the batched engine (SPEC G1, G2, S1–S4, K1–K4, T1, T2, L6, O1; seed 000 §4.3).

After ``choose`` the driver hands the token to :meth:`OutputProcessor.on_token`, which runs, in
this order (G1): record → EOS → (stop token-id sequences) → detokenize → stop-match → emit →
stop hit → max tokens → context limit → grammar termination → early-stop policy. It returns the
finish reason, or None to continue with ``decode_one``. At a normal end :meth:`drain` runs the
DRAINING step: after a stop hit the detokenizer's tail is discarded and ``finish()`` is not
called (G2); otherwise ``finish()`` drains the tail, which still passes the stop matcher.

Stop token-id sequences are matched on the id stream; ids that may still be the start of such a
sequence are held back from the detokenizer, exactly as bytes that may start a stop string are
held back from the stream, so a matched id sequence never leaks its text.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tokenizers

from coda import trace as tr
from coda.detokenizer import IncrementalDetokenizer
from coda.finish import FinishReason
from coda.stops import StopHit, StopStringMatcher, StopTokenMatcher
from coda.stream import RequestStream, TokenInfo
from coda.trace import TraceEvent, TraceSink

# A grammar hook answers "must the output end now?" after the token was consumed: True
# (grammar_complete) or the exact reason (grammar_forced_close, coda.engine.closure).
GrammarDone = Callable[[], "bool | FinishReason"]
# At max tokens / context limit: a grammar closed within the budget names its own reason.
GrammarBudgetEnd = Callable[[], "FinishReason | None"]
# An early-stop hook maps (token count, confidence) to a finish reason or None.
EarlyStopHook = Callable[[int, float], FinishReason | None]


@dataclass(frozen=True)
class OutputSpec:
    """Termination rules of one request, normalised once (S1)."""

    max_output_tokens: int
    context_limit: int
    prompt_len: int
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Stop strings are matched only up to the end of the first occurrence of this text (a tool
    # call's opening tag, issue 13); from there the grammar alone ends the output, so a stop
    # string never cuts a constrained call. Empty: stop strings apply everywhere.
    stops_end_at: bytes = b""


class OutputProcessor:
    """Turns selected tokens into stream deltas and finish decisions for one request."""

    def __init__(self, request_id: str, tokenizer: tokenizers.Tokenizer, spec: OutputSpec,
                 stream: RequestStream, trace: TraceSink, *,
                 prompt_token_ids: tuple[int, ...] = (),
                 grammar_done: GrammarDone | None = None,
                 early_stop: EarlyStopHook | None = None,
                 grammar_budget_end: GrammarBudgetEnd | None = None) -> None:
        self.request_id = request_id
        self.spec = spec
        self.stream = stream
        self.trace = trace
        self._tracing = not isinstance(trace, tr.NullTraceSink)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=spec.skip_special_tokens,
                                            prompt_token_ids=prompt_token_ids)
        self.stops = StopStringMatcher(spec.stop_strings,
                                       include_stop_in_output=spec.include_stop_str_in_output)
        self.token_stops = StopTokenMatcher(spec.stop_token_ids) if spec.stop_token_ids else None
        self._grammar_done = grammar_done
        self._grammar_budget_end = grammar_budget_end
        self._early_stop = early_stop
        self._held_ids: list[int] = []        # ids that may start a stop id sequence
        self._pending_tokens: list[TokenInfo] = []  # selected since the last delta
        self._eos_token: TokenInfo | None = None
        self.generated = 0                    # tokens selected (t after choose)
        self.hit: StopHit | None = None
        # L6 accounting: start offsets of visible tokens not yet reached by the stream
        self._visible = 0
        self._unreturned: deque[int] = deque()
        self.returned_tokens = 0
        self.emitted_bytes = 0
        self.stop_buffer_s = 0.0
        self._held_since: float | None = None
        self.last_confidence = 1.0
        self._stops_off = False               # past spec.stops_end_at
        self._tag_tail = b""                  # last bytes pushed, to find stops_end_at across pushes

    # -- the per-token checks of G1 --------------------------------------------------------
    def on_token(self, token_id: int, info: TokenInfo, decision: dict[str, Any] | None = None,
                 confidence: float = 1.0) -> FinishReason | None:
        self.generated += 1
        self.last_confidence = confidence
        t = self.generated
        if self._tracing:
            self._record(tr.TOKEN_SELECTED, t=t, token_id=token_id, decision=decision or {})
        if token_id in self.spec.eos_token_ids and not self.spec.ignore_eos:
            self._eos_token = info  # NOTE: never attached to a delta; reported as trailing
            return FinishReason.EOS
        self._pending_tokens.append(info)
        if self.token_stops is not None:
            hit = self.token_stops.push(token_id)
            if hit is not None:
                self._held_ids.clear()  # NOTE: the matched ids never reach the detokenizer
                return self._on_hit(hit)
            self._held_ids.append(token_id)
            # NOTE: hold exactly the ids that may still start a stop sequence (the matcher's depth)
            cut = len(self._held_ids) - self.token_stops.depth
            release, self._held_ids = self._held_ids[:cut], self._held_ids[cut:]
        else:
            release = [token_id]
        new = b"".join(self._detok_push(i) for i in release)
        if self._emit(new):
            return FinishReason.STOP_SEQUENCE
        if self.generated >= self.spec.max_output_tokens:
            return self._budget_end(FinishReason.MAX_OUTPUT_TOKENS)
        # the cache would hold prompt + t tokens after decoding y_t (seed: logical_length + 1)
        if self.spec.prompt_len + self.generated >= self.spec.context_limit:
            return self._budget_end(FinishReason.CONTEXT_LIMIT)
        if self._grammar_done is not None:
            done = self._grammar_done()
            if done:
                return done if isinstance(done, FinishReason) else FinishReason.GRAMMAR_COMPLETE
        if self._early_stop is not None:
            return self._early_stop(self.generated, confidence)
        return None

    def _budget_end(self, reason: FinishReason) -> FinishReason:
        # NOTE: still the budget's check (G1 order); only its name changes when the output
        # closed within it (issue 13, grammar_forced_close)
        if self._grammar_budget_end is not None:
            return self._grammar_budget_end() or reason
        return reason

    def drain(self, reason: FinishReason) -> FinishReason:
        """The DRAINING step for a normal end (G2). May turn the reason into stop_sequence
        when the drained tail hits a stop; raises DecodingError on an invalid residue (K3)."""
        if reason is FinishReason.STOP_SEQUENCE:
            self.detok.discard_pending()
            self.stops.discard()
            return reason
        tail = b"".join(self._detok_push(i) for i in self._held_ids)
        self._held_ids.clear()
        tail += self.detok.finish()
        if self._emit(tail):
            return FinishReason.STOP_SEQUENCE
        self._send(self.stops.flush())
        self._stop_held_clock()
        return reason

    def discard(self) -> None:
        """Cancel/failure path: drop everything not yet safe (seed §4.3)."""
        self.detok.discard_pending()
        if self.stops.hit is None:
            self.stops.discard()
        self._held_ids.clear()
        self._stop_held_clock()

    # -- accounting ------------------------------------------------------------------------
    def trailing_tokens(self) -> tuple[TokenInfo, ...]:
        """Selected tokens that no delta carried: held or textless ones, then EOS if chosen."""
        out = tuple(self._pending_tokens) + ((self._eos_token,) if self._eos_token else ())
        self._pending_tokens.clear()
        return out

    # -- internals -------------------------------------------------------------------------
    def _detok_push(self, token_id: int) -> bytes:
        data = self.detok.push(token_id)
        if data:  # L6: a token counts as returned once its first visible byte is sent
            self._unreturned.append(self._visible)
            self._visible += len(data)
        return data

    def _emit(self, new: bytes) -> bool:
        """Stop-match ``new`` and send the safe part; True on a stop hit (S2, S3)."""
        if not new:
            return False
        if self._stops_off:
            self._send(new)
            return False
        tag = self.spec.stops_end_at
        if tag:
            window = self._tag_tail + new
            at = window.find(tag)
            if at >= 0:
                end = at + len(tag) - len(self._tag_tail)  # NOTE: where the tag ends in ``new``
                if self._emit_matched(new[:end]):
                    return True
                # NOTE: the held suffix cannot complete a stop any more: release it, stop matching
                self._send(self.stops.flush())
                self._stop_held_clock()
                self._stops_off = True
                if self._tracing:
                    self._record(tr.STOP_STATE, held=0, detok_pending=len(self.detok.pending),
                                 stops_off=True)
                self._send(new[end:])
                return False
            self._tag_tail = window[-(len(tag) - 1):] if len(tag) > 1 else b""
        return self._emit_matched(new)

    def _emit_matched(self, new: bytes) -> bool:
        if not new:
            return False
        safe, hit = self.stops.push(new)
        if self._tracing:
            self._record(tr.STOP_STATE, held=len(self.stops.held),
                         detok_pending=len(self.detok.pending))
        self._send(safe)
        if hit is not None:
            self._on_hit(hit)
            return True
        self._track_hold()
        return False

    def _on_hit(self, hit: StopHit) -> FinishReason:
        self.hit = hit
        self._stop_held_clock()
        if self._tracing:
            self._record(tr.STOP_HIT, which=hit.kind, index=hit.index, stop=str(hit.stop),
                         byte_offset=hit.start)
        return FinishReason.STOP_SEQUENCE

    def _send(self, data: bytes) -> None:
        if not data:
            return
        ev = self.stream.delta(data, tuple(self._pending_tokens))
        self._pending_tokens.clear()
        self.emitted_bytes += len(data)
        while self._unreturned and self._unreturned[0] < self.emitted_bytes:
            self._unreturned.popleft()
            self.returned_tokens += 1
        if self._tracing:
            self._record(tr.STREAM_DELTA, seq=ev.seq, nbytes=len(data),
                         text=data.decode("utf-8", "replace"))

    def _track_hold(self) -> None:
        now = time.monotonic()
        if self.stops.held and self._held_since is None:
            self._held_since = now
        elif not self.stops.held:
            self._stop_held_clock(now)

    def _stop_held_clock(self, now: float | None = None) -> None:
        if self._held_since is not None:
            self.stop_buffer_s += (now or time.monotonic()) - self._held_since
            self._held_since = None

    def _record(self, kind: str, **data: Any) -> None:
        self.trace.record(TraceEvent(self.request_id, kind, data))
