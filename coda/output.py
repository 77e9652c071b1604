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

Both stop kinds see every token at once (S1, S4): each id is pushed to the id-sequence
matcher and then detokenized, and its bytes go through the string matcher, so a stop string
inside text whose ids might still start an id sequence ends the request at the token where it
completes. What such ids hold back is the *sending* of their bytes: bytes owned by the last
``depth`` ids (the id matcher's partial match) wait, like bytes that may start a stop string.
Reasoning (issue 23, :mod:`coda.reasoning`): while the output may open or is inside a
``<think>`` block, each token's bytes go to the splitter instead: reasoning bytes are sent at
once as reasoning deltas (no stop sees them; a possible closer prefix waits), the markers are
removed (recorded on the terminal and as ``reasoning.split`` rows), and bytes after the closer
start the answer, whose stream offsets (and the matchers') count from there. A reasoning
budget makes :meth:`OutputProcessor.forced_token` name the closer id the engine must choose.

Earliest end wins across kinds, counted in selected tokens; an id sequence and a string
completing at the same token: the id sequence wins (it is checked first, G1). On an id hit the
bytes of every token before the sequence's first id are sent; the sequence's own text never
is. Bytes the detokenizer still held for those tokens (a byte-fallback run the sequence closed)
are drained then and matched by the string matcher as it stood before the sequence: a stop
string they complete ends before the ids and wins (S4). Offsets (stream bytes, one owner token each)::

    stream  | sent ... | unsent: string-held or owned by held ids | (next push)
            0       sent_off                                  consumed
"""

from __future__ import annotations

import copy
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import tokenizers

from coda import trace as tr
from coda.detokenizer import IncrementalDetokenizer
from coda.errors import DecodingError
from coda.finish import FinishReason
from coda.reasoning import Phase, ReasoningSpec, ReasoningSplit, ReasoningSplitter
from coda.stops import STOP_RULE_VERSION, StopHit, StopStringMatcher, StopTokenMatcher
from coda.stream import RequestStream, TokenInfo, cut_to_text, shown_bytes, shown_piece
from coda.token_ends import TokenEnds
from coda.trace import TraceHandle, TraceSink

# A grammar hook answers "must the output end now?" after the token was consumed: True
# (grammar_complete) or the exact reason (grammar_forced_close, coda.engine.closure).
GrammarDone = Callable[[], "bool | FinishReason"]
# At max tokens / context limit: a grammar closed within the budget names its own reason.
GrammarBudgetEnd = Callable[[], "FinishReason | None"]


@dataclass(frozen=True)
class EarlyStopVerdict:
    """What the early-stop policy decided after one token (D2, D6): ``reason`` None to
    continue, else the stop's own reason, which the driver takes down the *cancel* path
    (:meth:`coda.request.RequestRun.conclude`); ``summary`` is the policy's state (committed
    tokens, saved bound, confidence) for the terminal. A decision, never a call back up."""

    reason: FinishReason | None
    summary: Mapping[str, object]


# An early-stop hook maps (token count, confidence) to its verdict.
EarlyStopHook = Callable[[int, float], EarlyStopVerdict]


@dataclass(frozen=True)
class OutputSpec:
    """Termination rules of one request, normalised once (S1). ``max_tokens``: the most tokens
    the request selects (the token budget, its one name; resolved by coda.engine.plan, never
    past the context); ``budget_end``: the reason reaching it ends with, ``max_output_tokens``,
    or ``context_limit`` where the plan found no budget before the context (L4). The plan
    decides both, so the per-token checks compare the count with one number, once (G1: the
    max-tokens check, then the context's, which a plan's budget always reaches first).

    The engine's plan (:class:`coda.engine.plan.RequestPlan`) extends this class: the core
    declares the part of the plan it reads, the engine hands it the plan itself (one frozen
    object per request); the reference loop and the processor's tests build one directly."""

    max_tokens: int
    budget_end: FinishReason = FinishReason.MAX_OUTPUT_TOKENS
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # K3 at the drain (UTF8_TAIL_POLICIES): "auto" (a budget end cuts a partial last character
    # off, recorded; any other end with one is FAILED), "fail" (the strict rule: FAILED,
    # decoding_error) or "drop" (any incomplete tail is removed, recorded, FINISHED)
    utf8_tail: str = "auto"
    # Stop strings are matched only up to the end of the first occurrence of this text (a tool
    # call's opening tag, issue 13); from there the grammar alone ends the output, so a stop
    # string never cuts a constrained call. Empty: stop strings apply everywhere.
    stops_end_at: bytes = b""
    # Stops (strings and id sequences) end the output only at a token t >= min_tokens; see
    # docs/api.md (issue 20 D6). EOS is banned by the sampler until then.
    min_tokens: int = 0
    # Issue 23: split ``<think>…</think>`` off the answer (coda.reasoning); None: no split.
    # Stops and their holdback apply to the answer only.
    reasoning: ReasoningSpec | None = None


UTF8_TAIL_POLICIES: tuple[str, ...] = ("auto", "fail", "drop")
"""K3 policies for a tail that is not whole characters when the output ends (docs/api.md)."""

# Ends where something other than the model cut the output (K3): a partial last character is
# text the budget did not finish. Cancel takes the discard path and never drains.
BUDGET_ENDS = frozenset({FinishReason.MAX_OUTPUT_TOKENS, FinishReason.CONTEXT_LIMIT,
                         FinishReason.DEADLINE_EXCEEDED})


class OutputProcessor:
    """Turns selected tokens into stream deltas and finish decisions for one request."""

    def __init__(self, request_id: str, tokenizer: tokenizers.Tokenizer, spec: OutputSpec,
                 stream: RequestStream, trace: TraceSink, *,
                 prompt_token_ids: tuple[int, ...] = (),
                 grammar_done: GrammarDone | None = None,
                 early_stop: EarlyStopHook | None = None,
                 grammar_budget_end: GrammarBudgetEnd | None = None) -> None:
        self.spec = spec
        self.stream = stream
        # NOTE: rows go through the request's handle, which stamps its id (one from
        # coda.request.RequestRun is kept; a bare sink gets its own)
        self.trace = trace if isinstance(trace, TraceHandle) else TraceHandle(trace, request_id)
        self._tracing = self.trace.enabled
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=spec.skip_special_tokens,
                                            prompt_token_ids=prompt_token_ids)
        self.stops = StopStringMatcher(spec.stop_strings,
                                       include_stop_in_output=spec.include_stop_str_in_output)
        self.token_stops = StopTokenMatcher(spec.stop_token_ids) if spec.stop_token_ids else None
        self._grammar_done = grammar_done
        self._grammar_budget_end = grammar_budget_end
        self._early_stop = early_stop
        # stream offset after each of the last pushes (owner boundaries of held ids, S1)
        self._ends: deque[int] = deque([0])
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
        self.generated = 0                    # tokens selected (t after choose)
        self.hit: StopHit | None = None
        self._draining = False  # no byte follows: a waiting tag start is text (stops_end_at)
        # L6 accounting: start offsets of visible tokens not yet reached by the stream
        self._visible = 0
        self._unreturned: deque[int] = deque()
        self.returned_tokens = 0
        self.emitted_bytes = 0
        # NOTE: (emitted_bytes, returned_tokens), set in one assignment after both moved: a
        # consistent pair for a reader on another thread (a worker's billing reports)
        self.sent_mark = (0, 0)
        self.stop_buffer_s = 0.0
        self._held_since: float | None = None
        # seed 004: the policy's last summary, and whether the policy (not the loop) stopped
        self.early_stop_summary: Mapping[str, object] | None = None
        self.stopped_early = False
        self.dropped_tail = b""  # K2: an incomplete UTF-8 tail removed at the end, recorded
        self._stops_off = False               # past spec.stops_end_at
        self._tag_tail = b""                  # last bytes pushed, to find stops_end_at across pushes
        self._armed = spec.min_tokens <= 0    # issue 20 D6: may a stop end the output here?
        self._armed_at = 0                    # issue 20 D6: offset where stop strings count
        # detokenizer states before each held id (the last ``depth``): on an id hit, the one
        # before the sequence's first id drains the text that precedes the sequence (S1)
        # NOTE: per held id of a pending id-sequence match: the detokenizer and the string
        # matcher (with a waiting tag start) as they were before that id (S1, S4)
        self._forks: deque[tuple[IncrementalDetokenizer, StopStringMatcher, bytes]] = deque()
        # L6: prompt tokens the prefix cache held; the driver sets it at the lookup, before any
        # token is selected (0: no prefix cache), and the first delta carries it (issue 20 D9)
        self.cached_prompt_tokens = 0
        self._hit_cut = b""  # a partial character an id sequence cut off, dropped at the drain
        # issue 23: the reasoning split; stream offsets below count answer bytes only, and
        # ``_answer_base`` is where the answer starts in the detokenized output (K2)
        self.splitter = ReasoningSplitter(spec.reasoning) if spec.reasoning else None
        self.reasoning_tokens = 0             # tokens selected inside the reasoning block
        self._forced = 0                      # closer ids the budget forced so far
        self._removed = 0                     # marker bytes removed (L6: never sent)
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
        if sp is not None and sp.phase is Phase.OPENING and sp.spec.open_ids and \
                token_id not in sp.spec.open_ids:
            sp.no_block()  # NOTE: the first token decides: an answer from its first byte
        if sp is not None and sp.phase is not Phase.ANSWER:
            if sp.in_reasoning:
                if self.forced_token() == token_id:
                    self._forced += 1
                self.reasoning_tokens += 1
            if self._reasoning_push(self._detok_push(token_id)):
                return FinishReason.STOP_SEQUENCE
            return self._after_emit(confidence)
        depth = 0
        if self.token_stops is not None:
            hit = self.token_stops.push(token_id, self._armed)
            if hit is not None:  # NOTE: its last id never reaches the detokenizer (ids first)
                earlier = self._end_before_ids(hit.end - hit.start)
                if earlier is not None:  # NOTE: S4: a stop string ending before the ids
                    return self._on_hit(earlier)
                if self._id_base:  # NOTE: issue 23: the matcher saw the answer's tokens only
                    hit = replace(hit, start=hit.start + self._id_base,
                                  end=hit.end + self._id_base)
                return self._on_hit(hit)
            depth = self.token_stops.depth
            if depth:
                self._forks.append((self.detok.fork(), copy.copy(self.stops),
                                    self._tag_tail))
                while len(self._forks) > depth:
                    self._forks.popleft()
            else:
                self._forks.clear()
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

    # -- the reasoning split (issue 23, coda.reasoning) ------------------------------------
    def forced_token(self) -> int | None:
        """The closer id the reasoning budget forces at the next step, or None (the engine
        masks the step to it, like the grammar closure)."""
        sp = self.splitter
        if sp is None or not sp.in_reasoning or sp.spec.budget_tokens is None:
            return None
        ids = sp.spec.close_ids
        if self._forced >= len(ids) or (not self._forced
                                        and self.reasoning_tokens < sp.spec.budget_tokens):
            return None
        return ids[self._forced]

    def forced_tokens(self) -> tuple[int, ...]:
        """Every closer id the reasoning budget still forces, in order, from
        :meth:`forced_token` on (issue 21 drafts them); () when none is forced now."""
        if self.forced_token() is None:
            return ()
        assert self.splitter is not None
        return self.splitter.spec.close_ids[self._forced:]

    def reasoning_split(self) -> ReasoningSplit | None:
        """The terminal's record of the split (K2), None without a reasoning block."""
        if self.splitter is None:
            return None
        return self.splitter.split(forced=self._forced > 0, tokens=self.reasoning_tokens)

    def _reasoning_push(self, data: bytes, final: bool = False) -> bool:
        """Bytes of the output while the reasoning block may open or is open: the reasoning
        part is sent at once (no stop sees it; a possible closer prefix waits), the markers
        are removed, and answer bytes after the closer go on to the stop matcher like any
        answer. True on a stop hit in those answer bytes."""
        sp = self.splitter
        assert sp is not None
        before = (len(sp.opener), len(sp.closer))
        reasoning, answer = sp.push(data)
        if final:
            more_r, more_a = sp.finish()
            reasoning, answer = reasoning + more_r, answer + more_a
        removed = len(sp.opener) + len(sp.closer) - sum(before)
        self._removed += removed
        self._advance_returned()
        if sp.phase is not Phase.ANSWER:
            if self._tracing and data:
                self._record(tr.STOP_STATE, nbytes=len(data), held=sp.held,
                             detok_pending=len(self.detok.pending), ids_held=0)
            if removed:
                self._record(tr.REASONING_SPLIT, removed=removed, part="opener")
            self._send(reasoning, reasoning=True)
            self._track_hold()
            return False
        # NOTE: the answer starts here: stream offsets (the matcher's too) count from it, and
        # the id matcher sees the tokens after this one
        self._answer_base = self.detok_bytes - len(answer)
        self._id_base = self.generated
        return self._emit(answer, 0, reasoning=reasoning, pre=len(data) - len(answer),
                          removed=removed)

    @property
    def detok_bytes(self) -> int:
        """Bytes the detokenizer produced so far."""
        return self._visible

    def _end_before_ids(self, k: int) -> StopHit | None:
        """An id sequence of ``k`` ids hit: send the whole text of the tokens before its first
        id, nothing of its own (S1, S3). ``_ends[-k]`` is the stream offset after the token
        before the sequence (its first k-1 ids were pushed); bytes those tokens left in the
        detokenizer (an open byte-fallback run, a partial character) are drained from its
        state before the sequence's first id: whole characters are sent, a partial last one is
        removed and recorded like a cut tail (K2, K3). The drained bytes are output, so they
        go through the stop-string matcher as it was before the sequence: a string they
        complete ends before the ids and wins (S4, earliest end; no stop string reaches the
        stream): it is returned, and only the text before it is sent."""
        upto = self._ends[-k]
        self._own = k  # NOTE: the sequence's own tokens: never reported (S3)
        discarded = self._sent_off + len(self._stream) - upto
        del self._stream[max(upto - self._sent_off, 0):]  # NOTE: the sequence's own bytes
        # NOTE: L6: the sequence's tokens are never returned (``_unreturned`` counts every
        # detokenized byte; stream offsets start at the answer, issue 23)
        while self._unreturned and self._unreturned[-1] >= upto + self._answer_base:
            self._unreturned.pop()
        # NOTE: the sequence's bytes are gone: what the fork drains below starts at ``upto``
        # (a byte run closed by the sequence's first id was counted from there already)
        self._visible = upto + self._answer_base
        self._token_ends.rewind(self._visible, k)
        det = self.detok
        if k > 1:
            det, self.stops, self._tag_tail = self._forks[-(k - 1)]
        residue = det.pending
        try:
            text, cut = det.finish_cut()
        except DecodingError:  # NOTE: bytes no byte could complete: removed as after a hit
            text, cut = b"", residue
        self.detok.discard_pending()
        self._forks.clear()
        self._hit_cut = cut  # NOTE: recorded by the drain, where the trace expects it (K3)
        self._token_ends.output(text)
        self._note_detok_end(0, fallback=not cut)
        hit = None
        if text:
            # NOTE: L6, K2: bytes drained here are output of the tokens before the sequence,
            # visible like a push's (the token they complete is returned)
            self._note_visible(text)
            self._stream += text
            self._draining = True  # NOTE: no byte follows: a waiting tag start is text
            hit = self._match(text)
            if self._tracing:
                # NOTE: ``discarded``: the sequence's own bytes, pushed while it was a partial
                # match, are gone: the checker's stream offsets go back to its start, where
                # the matcher held ``held_before`` bytes
                rewind = ({"discarded": discarded,
                           "held_before": len(self.stops.held) + len(self._tag_tail)}
                          if discarded else {})
                self._record(tr.STOP_STATE, nbytes=len(text), held=0, detok_pending=0,
                             ids_held=0, **rewind)
        self._release(self.stops.emitted_bytes if hit is not None
                      else self._sent_off + len(self._stream))
        return hit

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
        self._token_ends.output(tail)
        self._note_detok_end(0, fallback=not self.dropped_tail)
        if self.splitter is not None and self.splitter.phase is not Phase.ANSWER:
            if self._reasoning_push(tail, final=True):
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

    # -- accounting ------------------------------------------------------------------------
    def trailing_tokens(self) -> tuple[TokenInfo, ...]:
        """Selected tokens that no delta carried: held or textless ones, then EOS if chosen."""
        out = tuple(self._pending_tokens) + ((self._eos_token,) if self._eos_token else ())
        self._pending_tokens.clear()
        self._pending_ends.clear()
        return out

    # -- internals -------------------------------------------------------------------------
    def _detok_push(self, token_id: int) -> bytes:
        data = self.detok.push(token_id)
        if data:
            self._note_visible(data)
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

    def _note_visible(self, data: bytes) -> None:
        """L6: ``data`` is one token's first visible bytes; the token counts as returned once
        the first of them is sent (:meth:`_send`)."""
        self._unreturned.append(self._visible)
        self._visible += len(data)

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
            self._record(tr.STOP_STATE, **({"nbytes": nbytes} if nbytes else {}),
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
        """Push ``new`` through the string matcher, but only the free text before the first
        ``spec.stops_end_at`` (a tool call's opening tag; issue 13, issue 20 D2). Bytes that
        could still be the start of the tag wait, neither matched nor sent (the matcher's
        emitted count stays below them), until the tag completes — then stop strings are off
        and never see the tag — or cannot complete (a byte that breaks it, or the drain) —
        then they are matched as the free text they are. So a stop string occurring inside
        the tag (``">"``, ``"_call"``) never cuts a call; one in free text that merely looked
        like the tag's start still ends the output, decided when the tag is ruled out.
        ``_tag_tail`` holds those waiting bytes."""
        if self._stops_off:
            return None
        tag = self.spec.stops_end_at
        if not tag:
            return self.stops.push(new, self._armed)[1] if new else None
        window = self._tag_tail + new
        at = window.find(tag)
        if at >= 0:
            self._tag_tail = b""
            hit = self.stops.push(window[:at], self._armed)[1] if at else None
            if hit is None:
                self.stops.flush()
                self._stops_off = True
                self.token_stops = None  # NOTE: stop ids no longer apply inside a call either
                if self._tracing:
                    self._record(tr.STOP_STATE, held=0, detok_pending=len(self.detok.pending),
                                 stops_off=True)
            return hit
        keep = 0 if self._draining else _tag_start_len(window, tag)
        free, self._tag_tail = window[:len(window) - keep], window[len(window) - keep:]
        return self.stops.push(free, self._armed)[1] if free else None

    def _release(self, upto: int) -> None:
        """Send the unsent stream up to offset ``upto`` (nothing if already sent)."""
        n = upto - self._sent_off
        if n > 0:
            data = bytes(self._stream[:n])
            del self._stream[:n]
            self._sent_off = upto
            self._send(data)
        self._track_hold()

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

    def _send(self, data: bytes, reasoning: bool = False) -> None:
        if not data:
            return
        # NOTE: the first delta states the prefix-cache lookup's result (issue 20 D9)
        cached = self.cached_prompt_tokens if not self.emitted_bytes else None
        skip = self.spec.skip_special_tokens
        text_end = self.emitted_bytes + len(data) + self._removed
        if self._cutting:
            # NOTE: K2: the tokens' bytes end where the text ends (coda.stream.cut_to_text);
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
        ``_own``), cut to the text that was sent (:func:`coda.stream.cut_to_text`), stay
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

    def _advance_returned(self) -> None:
        """L6: tokens whose first visible byte the stream reached; removed reasoning markers
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


def _tag_start_len(data: bytes, tag: bytes) -> int:
    """Length of the longest suffix of ``data`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(data)), 0, -1):
        if data.endswith(tag[:n]):
            return n
    return 0
