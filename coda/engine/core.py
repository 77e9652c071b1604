"""The batched engine core: one step = schedule → forward → choose → per-token checks
(SPEC G1, T1–T4, C1–C3, L7; seed 000 §4.3, §4.4, §4.8).

Runs on ONE thread (the engine thread). Other threads only enqueue submissions and call
``EngineRequest.request_cancel`` — both are observed here, at the safe point before ``choose``.
Each request keeps the core's semantics exactly: the per-token checks are the shared
:class:`~coda.output.OutputProcessor`, and the endings are the shared :class:`~coda.request.RequestRun` that each
:class:`~coda.engine.engine_request.EngineRequest` is. The step's token choice (which logits
rows are whose, and the draw) is :mod:`coda.engine.core_choose`; a token's consequences
(:meth:`EngineCore._on_decision`) and the endings are here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import tokenizers
import torch

from coda import trace as tr
from coda.detokenizer import profile_of
from coda.engine.core_choose import choose, logit_rows
from coda.engine.core_failures import isolate, triage
from coda.engine.core_scoring import score_prompt
from coda.engine.core_spec import step_drafts
from coda.engine.draft import Drafter
from coda.engine.engine_request import EngineRequest
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.sampler import Sampler, TokenDecision
from coda.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from coda.engine.verify_costs import VerifyCosts
from coda.errors import BackpressureOverflowError, CodaError, ModelError
from coda.finish import CancelCause, FinishReason
from coda.lifecycle import ResourceKind, State
from coda.stream import TokenInfo
from coda.trace import TraceEvent, TraceSink

log = logging.getLogger("coda.engine")


_NONE: frozenset[int] = frozenset()  # NOTE: most steps score nothing: no set built


class EngineCore:
    """Owns scheduler, runner and sampler; :meth:`step` advances every live request once."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, tokenizer: tokenizers.Tokenizer,
                 trace: TraceSink, *, sampler: Sampler | None = None,
                 max_forward_retries: int = 1,
                 clock: Callable[[], float] = time.monotonic,
                 drafter: Drafter | None = None,
                 verify_costs: VerifyCosts | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.trace = trace
        self.sampler = sampler or Sampler()
        self.clock = clock
        self.requests: dict[int, EngineRequest] = {}
        self.num_preemptions_total = 0
        self.max_forward_retries = max_forward_retries
        self.num_retries_total = 0
        self._tracing = not isinstance(trace, tr.NullTraceSink)
        self.drafter = drafter  # issue 21 item 2: draft-model drafting (coda.engine.draft)
        self.verify_costs = verify_costs  # issue 21: prompt lookup's k by measured forwards
        # O1, echo: requests still scoring their prompt (every row's logits; no prefix reuse)
        self._scoring: set[int] = set()

    # -- admission ---------------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        """Register a validated request: QUEUED, holding a scheduler entry, a batch slot and
        its RNG state (each released exactly once by its lifecycle, L7)."""
        self.scheduler.add(req)
        self.requests[req.seq_id] = req
        req.acquire(ResourceKind.KV_CACHE, lambda: self._release_kv(req.seq_id))
        req.acquire(ResourceKind.BATCH_SLOT, lambda: self._release_slot(req.seq_id))
        req.acquire(ResourceKind.RNG_STATE, req.release_rng)
        if req.plan.prompt_logprobs is not None and req.num_prompt_tokens > 1:
            self._scoring.add(req.seq_id)
        req.lifecycle.transition(State.QUEUED)

    def _release_slot(self, seq_id: int) -> None:
        del self.requests[seq_id]
        self._scoring.discard(seq_id)

    def _release_kv(self, seq_id: int) -> None:
        self.scheduler.abort(seq_id)  # frees the blocks, if any, exactly once
        if self.drafter is not None:
            self.drafter.drop(seq_id)  # NOTE: and the draft's, with the same resource (L7)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # -- one step ----------------------------------------------------------------------------
    def step(self) -> int:
        """One engine step; returns the number of tokens computed (0 = nothing runnable)."""
        self._safe_point()
        paused = frozenset(sid for sid, r in self.requests.items() if r.stream.should_pause)
        # NOTE: a scoring request computes every prompt position: no prefix-cache reuse
        out = self.scheduler.schedule(paused=paused, drafts=self._drafts(paused),
                                      fresh=frozenset(self._scoring) if self._scoring else _NONE)
        self.num_preemptions_total += len(out.preempted)
        for seq in out.preempted:  # NOTE: T4, O1: each preemption is a row of the request's
            self.requests[seq.seq_id].note_preempted()
            if self.drafter is not None:  # NOTE: rebuilt by the draft's prefill when it resumes
                self.drafter.drop(seq.seq_id)
        if out.is_empty:
            return 0
        now = self.clock()
        for chunk in out.chunks:
            req = self.requests[chunk.seq.seq_id]
            if req.lifecycle.preempted:  # NOTE: blocks again: the re-prefill starts (T4)
                req.note_reacquired(chunk.start_pos)
            if not req.scheduled_once:
                req.scheduled_once = True
                req.open_stream()  # NOTE: P1: admitted: a deferred start event is written now
                req.cached_prompt_tokens = req.processor.cached_prompt_tokens = chunk.start_pos
                req.lifecycle.transition(State.PREFILLING)
                req.prefill_started = now
                self._record(req, tr.PREFILL_STARTED, tokens=chunk.seq.num_prompt_tokens,
                             cached=chunk.start_pos)
            elif chunk.need_logits and req.lifecycle.state is State.DECODING:
                self._record(req, tr.DECODE_STARTED, t=chunk.seq.num_output_tokens)
        seq_chunks = [self._seq_chunk(c) for c in out.chunks]  # NOTE: once: scoring may end
        logits, failed = self._execute(out, seq_chunks)
        self._triage_failures(failed)
        self.scheduler.on_step_done(out, skip=frozenset(failed))
        for chunk in out.chunks:
            self._account(chunk)
        spans = logit_rows(out, seq_chunks)
        self._score(spans, logits, failed)
        rows: list[tuple[EngineRequest, int, ScheduledChunk]] = []
        for at, chunk, scored in spans:
            if not chunk.need_logits:
                continue
            i = at + scored  # NOTE: the chunk's own row(s) follow its scoring rows
            live = self.requests.get(chunk.seq.seq_id)
            if live is None or live.lifecycle.is_terminal:
                continue
            if chunk.seq.seq_id in failed:
                continue  # retried next step (or already ended by the triage)
            rows.append((live, i, chunk))
        choose(self, rows, logits)
        return out.num_batched_tokens

    def _drafts(self, paused: frozenset[int]) -> dict[int, tuple[int, ...]]:
        """Issue 21: each speculating decoder's drafted tokens (coda.engine.core_spec); a step
        where no request speculates never enters the drafting."""
        if not any(r.spec is not None for r in self.requests.values()):
            return {}
        return step_drafts(self, paused)

    def _safe_point(self) -> None:
        """Observe cancels, deadlines and backpressure overflows before anything runs (C1, G3)."""
        now = self.clock()
        for req in list(self.requests.values()):
            if req.cancel_pending:
                req.cancel()
            elif req.deadline is not None and now >= req.deadline:
                self._finish(req, FinishReason.DEADLINE_EXCEEDED)

    def _execute(self, out: SchedulerOutput, chunks: list[SeqChunk]
                 ) -> tuple[torch.Tensor, dict[int, BaseException]]:
        """Run the batch; on failure retry each chunk alone so one bad request fails alone."""
        try:
            if self.drafter is not None:  # NOTE: drafts are priced by the step's measured cost
                return self.drafter.timed_forward(self.runner.execute, chunks), {}
            if self.verify_costs is not None:
                return self.verify_costs.timed(self.runner.execute, chunks), {}
            return self.runner.execute(chunks), {}
        except Exception as exc:  # isolate the culprit(s)
            log.warning("batch forward failed (%r); isolating", exc)
        return isolate(self, out, chunks)

    def _triage_failures(self, failed: dict[int, BaseException]) -> None:
        """Seed 004, D5: each failed forward retried before its first frame, else ended
        (coda.engine.core_failures)."""
        if failed:  # NOTE: a step whose forward succeeded never enters coda.engine.core_failures
            triage(self, failed)

    def _seq_chunk(self, c: ScheduledChunk) -> SeqChunk:
        if self._scored_rows(c):  # NOTE: every row: the prompt's scores, then the next token's
            return SeqChunk(c.token_ids, c.start_pos, tuple(c.seq.block_table), True,
                            c.num_tokens)
        return SeqChunk(c.token_ids, c.start_pos, tuple(c.seq.block_table), c.need_logits,
                        1 + c.num_draft)

    def _scored_rows(self, c: ScheduledChunk) -> int:
        """The rows at the start of a scoring request's chunk that score a prompt token: the
        row of position ``p`` gives prompt token ``p + 1``'s record (O1, echo)."""
        if c.seq.seq_id not in self._scoring or c.num_draft:
            return 0
        return max(0, min(c.start_pos + c.num_tokens, c.seq.num_prompt_tokens - 1) - c.start_pos)

    def _score(self, spans: list[tuple[int, ScheduledChunk, int]], logits: torch.Tensor,
               failed: dict[int, BaseException]) -> None:
        """O1, echo: the prompt's scoring rows become its records (coda.engine.core_scoring);
        a step without scoring rows never enters it."""
        if any(n for _, _, n in spans):
            score_prompt(self, spans, logits, failed)

    def _account(self, chunk: ScheduledChunk) -> None:
        req = self.requests.get(chunk.seq.seq_id)
        if req is None:
            return
        end = chunk.start_pos + chunk.num_tokens - chunk.num_draft  # NOTE: drafts: on commit
        if end <= req.computed_high:
            return  # recomputation after preemption is not counted twice (L6)
        p = chunk.seq.num_prompt_tokens
        start = max(chunk.start_pos, req.computed_high)
        req.processed_prompt_tokens += max(0, min(end, p) - max(start, p if start >= p else start))
        new_out = max(0, end - max(start, p))
        req.processed_output_tokens += new_out
        req.computed_high = end
        if new_out and req.lifecycle.state is State.DECODING:
            self._record(req, tr.DECODE_COMPLETED, t=chunk.seq.num_output_tokens,
                         cache_len=chunk.seq.num_computed_tokens)

    def _keep_closable(self, req: EngineRequest, dec: TokenDecision,
                       logits: torch.Tensor) -> TokenDecision:
        """Issue 13: a token after which the output could no longer close within the budget is
        replaced by the same step's draw under the closing path's mask (same counter uniform)."""
        closer = req.closer
        assert closer is not None
        if closer.admits(dec.token_id, req.plan.eos_token_ids):
            return dec
        path = closer.force()
        if path is not None and not path.tokens:  # NOTE: accepting already: end here (EOS)
            path = closer.end_now(req.plan.eos_token_ids)
        self._record(req, tr.GRAMMAR_FORCED, rejected=dec.token_id,
                     path_tokens=len(path) if path is not None else None,
                     path_text=path.text.decode("utf-8", "replace") if path is not None else None)
        if path is None or not path.tokens:
            return dec
        return self.sampler.sample(logits.clone(), [req.sampling_row(self._vocab)])[0]

    @property
    def _vocab(self) -> int:
        return self.runner.config.vocab_size

    def _on_decision(self, req: EngineRequest, dec: TokenDecision) -> None:
        req.append_token(dec.token_id)
        req.rng_step = req.num_output_tokens
        if req.first_token_at is None:
            req.first_token_at = self.clock()
        if req.grammar is not None and dec.token_id in req.processor.opener_ids():
            req.hold_grammar()  # NOTE: issue 23: the block opens: the opener is not the answer's
        if req.grammar is not None and not req.grammar.consume(dec.token_id):
            stuck = req.grammar.error if req.grammar.stuck else None  # NOTE: a mask that hung
            self._end_failed(req, ModelError(stuck or f"grammar rejected token {dec.token_id}"))
            return
        info = self._logprob_info(dec) if req.plan.logprobs else TokenInfo(dec.token_id)
        try:
            record = dec.to_record() if self._tracing else None  # NOTE: hot path: no dict unless traced
            reason = req.processor.on_token(dec.token_id, info, record, dec.prob)
        except BackpressureOverflowError as exc:  # P6 (3): past the bound, its own error
            self._end_failed(req, exc)
            return
        if reason is FinishReason.EOS and req.closer is not None and req.closer.forcing:
            reason = FinishReason.GRAMMAR_FORCED_CLOSE  # NOTE: the closer chose EOS (end_now)
        if req.held is not None and req.processor.answering:
            req.release_grammar()  # NOTE: issue 23: this token closed the block
        if reason is not None:
            req.conclude(reason)  # NOTE: an early stop takes the cancel path (D6)

    def _logprob_info(self, dec: TokenDecision) -> TokenInfo:
        """The token with its logprobs and the exact bytes of it and its alternatives."""
        profile = profile_of(self.tokenizer)
        return TokenInfo(dec.token_id, dec.logprob, dec.top_logprobs,
                         piece=profile.piece(dec.token_id),
                         top_pieces=tuple(profile.piece(i) for i, _ in dec.top_logprobs),
                         special=dec.token_id in profile.special_ids)

    # -- endings -------------------------------------------------------------------------------
    def _finish(self, req: EngineRequest, reason: FinishReason) -> None:
        req.finish(reason)

    def _end_failed(self, req: EngineRequest, exc: BaseException) -> None:
        err = exc if isinstance(exc, CodaError) else ModelError(f"forward failed: {exc!r}")
        reason = (FinishReason.TRANSPORT_ERROR if isinstance(exc, BackpressureOverflowError)
                  else FinishReason.MODEL_ERROR)
        if req.lifecycle.is_terminal:
            return
        if req.lifecycle.state is State.CANCEL_REQUESTED:
            req.cancel()
            return
        req.fail(err, reason)

    def abort_all(self, cause: CancelCause) -> None:
        """Shutdown: every live request ends CANCELLED with a terminal event."""
        for req in list(self.requests.values()):
            req.request_cancel(cause)
            req.cancel()

    def _record(self, req: EngineRequest, kind: str, **data: object) -> None:
        if self._tracing:  # NOTE: through the request's trace handle (L7), never after its seal
            req.trace.record(TraceEvent(req.request_id, kind, data))
