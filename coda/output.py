"""Per-token output processing: the middle of the §4.3 loop, shared by the reference loop and
the batched engine (SPEC G1, G2, S1–S4, K1–K4, T1, T2, L6, O1; seed 000 §4.3).

After ``choose`` the driver hands the token to :meth:`OutputProcessor.on_token`, which runs, in
this order (G1): record → EOS → (stop token-id sequences) → detokenize → stop-match → emit →
stop hit → max tokens → context limit → grammar termination → early-stop policy. Max tokens and
the context limit are one comparison here: the plan's budget never passes the context, and the
plan fixed which of the two reaching it means (``OutputSpec.budget_end``, L4). It returns the
finish reason, or None to continue with ``decode_one``. At a normal end :meth:`drain` runs the
DRAINING step: after a stop hit the detokenizer's tail is discarded and ``finish()`` is not
called (G2); otherwise ``finish()`` drains the tail, which still passes the stop matcher.

This module decides how far the output may go and where it ends: the stop-string match and
its hold (S2), a stop hit (S3), the budget, grammar and early-stop checks (G1, L4, D6), the
drain and its K3 tail policy (G2), the cancel path. Its neighbours, one concept each:
:mod:`coda.output_spec` (the rules, :class:`OutputSpec`, and the hooks), :mod:`coda.output_delta`
(the processor's base: what each delta carries, K2 token entries, L6 counts, P5),
:mod:`coda.output_ids` (stop token-id sequences, S1/S4), :mod:`coda.output_reasoning` (the
``<think>`` split, issue 23) and :mod:`coda.output_tag` (stop strings up to a tool call's tag,
issue 13): these three run only for a request that has what they handle.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any

import tokenizers

from coda import output_ids, output_reasoning, output_tag
from coda import trace as tr
from coda.detokenizer import IncrementalDetokenizer
from coda.errors import DecodingError
from coda.finish import FinishReason
from coda.output_delta import DeltaAssembly
from coda.output_spec import (
    BUDGET_ENDS,
    UTF8_TAIL_POLICIES,
    EarlyStopHook,
    EarlyStopVerdict,
    GrammarBudgetEnd,
    GrammarDone,
    OutputSpec,
)
from coda.reasoning import Phase, ReasoningSplit, ReasoningSplitter
from coda.stops import STOP_RULE_VERSION, StopHit, StopStringMatcher
from coda.stops_ids import StopTokenMatcher
from coda.stream import RequestStream, TokenInfo, shown_piece
from coda.trace import TraceSink

# NOTE: the rules' names stay importable from here, the processor's module (the engine's plan,
# the request run, the benchmarks); their home is coda.output_spec
__all__ = ["BUDGET_ENDS", "UTF8_TAIL_POLICIES", "EarlyStopHook", "EarlyStopVerdict",
           "GrammarBudgetEnd", "GrammarDone", "OutputProcessor", "OutputSpec"]


class OutputProcessor(DeltaAssembly):
    """Turns selected tokens into stream deltas and finish decisions for one request."""

    def __init__(self, request_id: str, tokenizer: tokenizers.Tokenizer, spec: OutputSpec,
                 stream: RequestStream, trace: TraceSink, *,
                 prompt_token_ids: tuple[int, ...] = (),
                 grammar_done: GrammarDone | None = None,
                 early_stop: EarlyStopHook | None = None,
                 grammar_budget_end: GrammarBudgetEnd | None = None) -> None:
        super().__init__(request_id, tokenizer, spec, stream, trace, prompt_token_ids)
        self.stops = StopStringMatcher(spec.stop_strings,
                                       include_stop_in_output=spec.include_stop_str_in_output)
        self.token_stops = StopTokenMatcher(spec.stop_token_ids) if spec.stop_token_ids else None
        self._grammar_done = grammar_done
        self._grammar_budget_end = grammar_budget_end
        self._early_stop = early_stop
        # stream offset after each of the last pushes (owner boundaries of held ids, S1)
        self._ends: deque[int] = deque([0])
        self.generated = 0                    # tokens selected (t after choose)
        self.hit: StopHit | None = None
        self._draining = False  # no byte follows: a waiting tag start is text (stops_end_at)
        # seed 004: the policy's last summary, and whether the policy (not the loop) stopped
        self.early_stop_summary: Mapping[str, object] | None = None
        self.stopped_early = False
        self.dropped_tail = b""  # K2: an incomplete UTF-8 tail removed at the end, recorded
        self._stops_off = False               # past spec.stops_end_at
        self._tag_tail = b""                  # last bytes pushed, to find stops_end_at across pushes
        self._armed = spec.min_tokens <= 0    # issue 20 D6: may a stop end the output here?
        self._armed_at = 0                    # issue 20 D6: offset where stop strings count
        # NOTE: per held id of a pending id-sequence match: the detokenizer and the string
        # matcher (with a waiting tag start) as they were before that id (S1, S4); on an id
        # hit, the one before the sequence's first id drains the text before it (output_ids)
        # and the L6 count of tokens waiting for their first byte (``_waiting``)
        self._forks: deque[tuple[IncrementalDetokenizer, StopStringMatcher, bytes, int]] = deque()
        self._hit_cut = b""  # a partial character an id sequence cut off, dropped at the drain
        # issue 23: the reasoning split (coda.output_reasoning); stream offsets count answer
        # bytes only, and ``_answer_base`` is where the answer starts in the detokenized
        # output (K2)
        self.splitter = ReasoningSplitter(spec.reasoning) if spec.reasoning else None
        self.reasoning_tokens = 0             # tokens selected inside the reasoning block
        self._forced = 0                      # closer ids the budget forced so far
        self._answer_base = 0
        self._id_base = 0                     # tokens selected before the answer's first

    # -- the per-token checks of G1 --------------------------------------------------------
    def on_token(self, token_id: int, info: TokenInfo, decision: dict[str, Any] | None = None,
                 confidence: float = 1.0) -> FinishReason | None:
        self.generated += 1
        t = self.generated
        if self._tracing:
            self._record(tr.TOKEN_SELECTED, t=t, token_id=token_id, decision=decision or {})
        if token_id in self.spec.eos_token_ids and not self.spec.ignore_eos:
            self._eos_token = info  # NOTE: never attached to a delta; reported as trailing
            return FinishReason.EOS
        self._token_ends.push(shown_piece(info, self.spec.skip_special_tokens))
        self._pending_tokens.append(info)
        self._pending_ends.append(None)
        # NOTE: issue 20 D6: a stop completing before token min_tokens is ordinary output
        if not self._armed and t >= self.spec.min_tokens:
            self._armed, self._armed_at = True, self.stops.consumed_bytes
        sp = self.splitter
        if sp is not None and output_reasoning.takes(self, sp, token_id):
            if output_reasoning.push(self, self._detok_push(token_id)):
                return FinishReason.STOP_SEQUENCE
            return self._after_emit(confidence)
        depth = 0
        if self.token_stops is not None:
            hit = output_ids.push(self, self.token_stops, token_id)
            if hit is not None:
                return self._on_hit(hit)
            depth = self.token_stops.depth
        if self._emit(self._detok_push(token_id), depth):
            return FinishReason.STOP_SEQUENCE
        return self._after_emit(confidence)

    def _after_emit(self, confidence: float) -> FinishReason | None:
        """The checks after the emit (G1): the budget (max tokens or context), grammar,
        early stop."""
        if self.budget_spent:
            return self._budget_end(self.spec.budget_end)
        if self._grammar_done is not None:
            done = self._grammar_done()
            if done:
                return done if isinstance(done, FinishReason) else FinishReason.GRAMMAR_COMPLETE
        if self._early_stop is not None:
            verdict = self._early_stop(self.generated, confidence)
            self.early_stop_summary = verdict.summary
            self.stopped_early = verdict.reason is not None  # NOTE: D6: the cancel path
            return verdict.reason
        return None

    @property
    def budget_spent(self) -> bool:
        """The budget's one per-token check (G1, L4): the tokens selected reached the plan's
        ``max_tokens`` (at once for a budget of 0: prefill only, no token is chosen)."""
        return self.generated >= self.spec.max_tokens

    @property
    def tokens_left(self) -> int:
        """Tokens the request may still select within its budget (issue 21 drafts no more)."""
        return self.spec.max_tokens - self.generated

    # -- the reasoning split (issue 23, coda.output_reasoning) -----------------------------
    def forced_token(self) -> int | None:
        """The closer id the reasoning budget forces at the next step, or None (the engine
        masks the step to it, like the grammar closure)."""
        sp = self.splitter
        return None if sp is None else output_reasoning.forced_token(self, sp)

    def forced_tokens(self) -> tuple[int, ...]:
        """Every closer id the reasoning budget still forces, in order, from
        :meth:`forced_token` on (issue 21 drafts them); () when none is forced now."""
        sp = self.splitter
        return () if sp is None else output_reasoning.forced_tokens(self, sp)

    def opener_ids(self) -> tuple[int, ...]:
        """The opener's ids while the output's first token may still open a reasoning block,
        else () (a grammar's mask allows them there: the engine's ``EngineCore._row``)."""
        sp = self.splitter
        return sp.spec.open_ids if sp is not None and sp.phase is Phase.OPENING else ()

    @property
    def answering(self) -> bool:
        """The output is in its answer: no split, or the block closed or never opened (the
        grammar constrains from here: issue 23)."""
        return self.splitter is None or self.splitter.phase is Phase.ANSWER

    def reasoning_split(self) -> ReasoningSplit | None:
        """The terminal's record of the split (K2), None without a reasoning block."""
        if self.splitter is None:
            return None
        return self.splitter.split(forced=self._forced > 0, tokens=self.reasoning_tokens)

    # -- the end: the drain (G2, K3) and the cancel path -----------------------------------
    def _drop_tail(self, tail: bytes) -> None:
        """K2: an incomplete UTF-8 tail removed at the end, recorded."""
        self.dropped_tail = tail
        self._record(tr.UTF8_TAIL_DROPPED, nbytes=len(tail), hex=tail.hex())

    def _budget_end(self, reason: FinishReason) -> FinishReason:
        # NOTE: still the budget's check (G1 order); only its name changes when the output
        # closed within it (issue 13, grammar_forced_close)
        if self._grammar_budget_end is not None:
            return self._grammar_budget_end() or reason
        return reason

    def drain(self, reason: FinishReason) -> FinishReason:
        """The DRAINING step for a normal end (G2). May turn the reason into stop_sequence
        when the drained tail hits a stop; raises DecodingError on an invalid residue (K3)."""
        self._draining = True
        if reason is FinishReason.STOP_SEQUENCE:
            self.detok.discard_pending()
            self.stops.discard()
            if self._hit_cut:
                self._drop_tail(self._hit_cut)
            return reason
        tail = self._finish_detokenizer(reason)
        if tail:
            self._note_visible(tail, self._waiting)  # NOTE: L6: held tokens' bytes, released
        self._token_ends.output(tail)
        self._note_detok_end(0, fallback=not self.dropped_tail)
        if self.splitter is not None and self.splitter.phase is not Phase.ANSWER:
            if output_reasoning.push(self, tail, final=True):
                return FinishReason.STOP_SEQUENCE
        elif self._emit(tail, 0):
            return FinishReason.STOP_SEQUENCE
        self.stops.flush()
        self._release(len(self._stream) + self._sent_off)
        self._stop_held_clock()
        return reason

    def _finish_detokenizer(self, reason: FinishReason) -> bytes:
        """``finish()`` under the request's ``utf8_tail`` policy (K3): "auto" at a budget end
        sends the whole characters and removes a partial last one, recorded (K2 removed span;
        a residue no byte could complete still fails); "drop" removes any incomplete tail,
        recorded; otherwise an incomplete tail raises DecodingError (the request ends FAILED)."""
        policy = self.spec.utf8_tail
        if policy == "drop" or (policy == "auto" and reason in BUDGET_ENDS):
            pending = self.detok.pending
            try:
                text, cut = self.detok.finish_cut()
            except DecodingError:
                if policy != "drop":
                    raise
                text, cut = b"", pending
            if cut:
                self._drop_tail(cut)
                self._report_dropped(len(cut))
            return text
        return self.detok.finish()

    def discard(self) -> None:
        """Cancel/failure path: drop everything not yet safe (seed §4.3)."""
        self.detok.discard_pending()
        if self.stops.hit is None:
            self.stops.discard()
        if self.splitter is not None:
            # NOTE: a held marker prefix is never sent: dropped, not counted as reasoning (K2)
            self.splitter.discard()
        self._stream.clear()
        self._stop_held_clock()

    # -- stop matching and hits (S2, S3) ---------------------------------------------------
    def _emit(self, new: bytes, held_ids: int, *, reasoning: bytes = b"", pre: int = 0,
              removed: int = 0) -> bool:
        """Stop-match ``new`` (this token's bytes) and send what is safe: not held by the string
        matcher and not owned by the last ``held_ids`` tokens. True on a string hit (S2, S3).
        Issue 23: the token that closes the reasoning block passes its ``reasoning`` bytes
        (sent first, unmatched) and ``pre``, its bytes before ``new`` (reasoning and the
        ``removed`` markers), so its trace row counts all its bytes."""
        self._stream += new
        self._own = held_ids
        end = self._sent_off + len(self._stream)
        self._ends.append(end)
        # NOTE: keep one boundary per held id plus the one before them, no more
        while len(self._ends) > held_ids + 2:
            self._ends.popleft()
        # NOTE: a drain matches bytes waiting as a possible tool-call tag start, pushing none
        matched = bool(new) or bool(pre) or (self._draining and bool(self._tag_tail))
        hit = self._match(new) if new or self._draining else None
        if self._tracing and matched:
            # NOTE: nbytes (what this push added) lets the checker recount S2 holds and L6;
            # bytes waiting as a possible tag start are held too (S2)
            nbytes = len(new) + pre
            # NOTE: starts: the tokens whose first bytes these are (the checker's L6 count)
            self._record(tr.STOP_STATE, **({"nbytes": nbytes, "starts": self._starts}
                                           if nbytes else {}),
                         held=len(self.stops.held) + len(self._tag_tail),
                         detok_pending=len(self.detok.pending), ids_held=held_ids)
        if removed:
            self._record(tr.REASONING_SPLIT, removed=removed, part="closer",
                         answer_at=self._answer_base)
        self._send(reasoning, reasoning=True)
        if hit is not None:
            # NOTE: the matcher's emitted count is the stream offset where output stops
            self._cutting, self._own = True, 0  # NOTE: a string may cut inside held ids
            self._release(self.stops.emitted_bytes)
            self._on_hit(hit)
            return True
        # NOTE: past stops_end_at the matcher sees nothing more: every byte is string-safe
        safe = end if self._stops_off else self.stops.emitted_bytes
        self._release(min(safe, self._ends[-held_ids - 1]))
        return False

    def _match(self, new: bytes) -> StopHit | None:
        """Push ``new`` through the string matcher (S2); with a tool call's opening tag
        (``spec.stops_end_at``, issue 13) only the free text before it, a possible tag start
        waiting (:mod:`coda.output_tag`); nothing once past the tag."""
        if self._stops_off:
            return None
        tag = self.spec.stops_end_at
        if not tag:
            return self.stops.push(new, self._armed)[1] if new else None
        return output_tag.match(self, tag, new)

    def _on_hit(self, hit: StopHit) -> FinishReason:
        self.hit = hit
        self._report_cut()
        self._stop_held_clock()
        if self._tracing:
            armed = {"armed_at": self._armed_at} if self.spec.min_tokens > 0 else {}
            self._record(tr.STOP_HIT, which=hit.kind, index=hit.index, stop=str(hit.stop),
                         byte_offset=hit.start + self._answer_base if hit.kind == "string"
                         else hit.start, stop_rule_version=STOP_RULE_VERSION, **armed)
        return FinishReason.STOP_SEQUENCE
