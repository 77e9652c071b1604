"""The batched engine core: one step = schedule → forward → choose → per-token checks
(SPEC G1, T1–T4, C1–C3, L7; seed 000 §4.3, §4.4, §4.8).

Runs on ONE thread (the engine thread). Other threads only enqueue submissions and call
``EngineRequest.request_cancel`` — both are observed here, at the safe point before ``choose``.
Each request keeps the core's semantics exactly: the per-token checks are the shared
:class:`~coda.output.OutputProcessor`, and the endings are the shared :class:`~coda.request.RequestRun` that each
:class:`EngineRequest` is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import tokenizers
import torch

from coda import trace as tr
from coda.detokenizer import profile_of
from coda.early_stop import EarlyStopController
from coda.engine.closure import BudgetCloser
from coda.engine.core_failures import isolate, triage
from coda.engine.core_scoring import score_prompt
from coda.engine.core_spec import emit_verified, step_drafts
from coda.engine.draft import Drafter
from coda.engine.early_stop_hook import make_hook
from coda.engine.grammar import GrammarMatcher
from coda.engine.plan import RequestPlan
from coda.engine.prediction import prediction_counts as count_prediction
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.sampler import Sampler, SamplingRow, TokenDecision
from coda.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from coda.engine.sequence import Sequence
from coda.engine.speculative import SpeculativeConfig, state_for
from coda.engine.speculative_verify import verify_rows
from coda.engine.verify_costs import VerifyCosts
from coda.errors import BackpressureOverflowError, CodaError, ModelError
from coda.finish import CancelCause, FinishReason
from coda.lifecycle import ResourceKind, State
from coda.output import OutputProcessor
from coda.request import RequestRun
from coda.stream import TokenInfo
from coda.trace import TraceEvent, TraceSink

log = logging.getLogger("coda.engine")


class EngineRequest(RequestRun, Sequence):
    """The engine's one live object per request (issue 22): the request's run (lifecycle with
    its resources, stream, output processor, trace handle and the three endings, inherited
    from :class:`RequestRun`), its token state (ids, tokens, blocks, status: it *is* the
    :class:`Sequence` the scheduler, the block manager and the drafter move), and what only the
    engine keeps: the frozen plan, the RNG state (seed, step), the grammar's state, the closer
    and the drafting state; everything is released through ``lifecycle`` (L7).

    It is built from the plan and its parts in one place, here: its token state, its output
    processor and its drafting state follow from the plan, and the processor's hooks from the
    grammar, the closer and the early-stop controller it holds (so a hook never disagrees with
    what the request keeps).

    Why it has two bases rather than one class: :class:`RequestRun` is also the reference
    loop's request (tests/reference_loop.py, the engine's oracle, ends its requests through the
    very same code) and :class:`Sequence` is tested alone with the scheduler and the block
    manager (no engine); the two share no attribute. The
    :class:`~coda.engine.protocol.RequestHandle` is the caller's view (any thread: cancel is C1's
    moment 1 plus a wake-up), never handed the engine thread's endings (``cancel`` here is
    C1's moment 3, ``finish``, ``fail``)."""

    def __init__(self, plan: RequestPlan, seq_id: int, tokenizer: tokenizers.Tokenizer,
                 trace: TraceSink, *, arrival: float, grammar: GrammarMatcher | None = None,
                 early_stop: EarlyStopController | None = None,
                 closer: BudgetCloser | None = None,
                 speculative: SpeculativeConfig | None = None, model: str | None = None,
                 model_snapshot: str | None = None,
                 predicted: SpeculativeConfig | None = None) -> None:
        # NOTE: the one constructor of the parts (RequestRun's): stream (opened with its
        # start event for ``model``), trace handle, processor and its hooks, in one call
        RequestRun.__init__(
            self, plan.request_id, None, trace, model=model, model_snapshot=model_snapshot,
            prompt_tokens=len(plan.prompt_token_ids),
            arrival=arrival, output=plan, tokenizer=tokenizer,
            prompt_token_ids=plan.prompt_token_ids, backpressure=plan.backpressure,
            grammar_done=(closer.done if closer is not None else
                          grammar.is_terminated if grammar is not None else None),
            early_stop=(make_hook(early_stop, arrival, grammar) if early_stop is not None
                        else None),
            grammar_budget_end=closer.budget_end if closer is not None else None)
        # NOTE: issue 22: the request *is* its sequence (the scheduler's and block manager's
        # view: ids, tokens, blocks), so no second object a request carries or looks up
        Sequence.__init__(self, seq_id, list(plan.prompt_token_ids), plan.max_total_tokens)
        self.plan = plan
        # NOTE: absolute (monotonic), from plan.deadline_s
        self.deadline = arrival + plan.deadline_s if plan.deadline_s is not None else None
        self.grammar = grammar
        self.early_stop = early_stop
        self.closer = closer                 # issue 13: close within the budget
        # NOTE: issue 23: a grammar constrains the answer only: while the reasoning block may
        # open or is open it is held here (``grammar``, ``closer`` None: the step is free and
        # advances nothing), then restored at the answer's first token (release_grammar)
        self.held: tuple[GrammarMatcher, BudgetCloser | None] | None = None
        if grammar is not None and plan.reasoning is not None and plan.reasoning.inside:
            self.hold_grammar()
        # NOTE: issue 21: drafting state (None: off on the server or for this request)
        # NOTE: issue 22: speculation off on the server: the drafting module is never entered
        # NOTE: a chat prediction drafts under ``predicted`` (None: the mode cannot verify)
        self.spec = spec = (state_for(speculative, plan, predicted) if speculative is not None
                            or (predicted is not None and plan.prediction) else None)
        if spec is not None:
            self.speculative = spec.counts   # NOTE: the terminal reports them (coda.speculative)
        # T4, L7: the request's whole RNG state is the counter RNG's (seed, step), which every
        # sampling row reads (EngineCore._row); the RNG itself keeps no state (coda.engine.rng),
        # so these two are what the rng_state resource holds (released: see release_rng)
        self._rng_seed: int | None = plan.seed
        self.rng_step = 0
        self.computed_high = 0               # highest num_computed_tokens reached (L6)
        self.retries = 0                     # forward retries used (seed 004 D5)
        self.scheduled_once = False

    @property
    def processor(self) -> OutputProcessor:
        proc = self._processor
        assert proc is not None  # NOTE: built with one: an engine request selects tokens
        return proc

    @property
    def rng_seed(self) -> int:
        """The seed every sampling row of the request draws with; after the ``rng_state``
        release any later draw is a loud error instead of a silently reused stream (L7)."""
        if self._rng_seed is None:
            raise RuntimeError("the request's RNG state was released; no draw may follow")
        return self._rng_seed

    def prediction_counts(self) -> Mapping[str, int] | None:
        """The prediction's accepted / rejected tokens against the output token ids
        (coda.engine.prediction): the same whether or not it drafted."""
        if self.plan.prediction is None:
            return None
        return count_prediction(self.plan.prediction, self.output_token_ids)

    def hold_grammar(self) -> None:
        """Issue 23: the reasoning block opens (or the prompt opened it): the grammar and its
        closer wait for the answer, untouched by the reasoning tokens."""
        assert self.grammar is not None
        self.held, self.grammar, self.closer = (self.grammar, self.closer), None, None

    def release_grammar(self) -> None:
        """Issue 23: the block closed (the model's closer, or the budget's forced one): the
        grammar constrains from the next token, and its closer keeps the answer within the
        tokens the budget has left (G1: the budget's one end, unchanged)."""
        assert self.held is not None
        (self.grammar, self.closer), self.held = self.held, None
        if self.closer is not None:
            self.closer.budget = self.grammar.num_consumed + self.processor.tokens_left

    def release_rng(self) -> dict[str, int]:
        """The ``rng_state`` resource's release: no draw may follow; reports the last step."""
        self._rng_seed = None
        return {"step": self.rng_step}


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
        if self.drafter is not None:
            for seq in out.preempted:  # NOTE: rebuilt by the draft's prefill when it resumes
                self.drafter.drop(seq.seq_id)
        if out.is_empty:
            return 0
        now = self.clock()
        for chunk in out.chunks:
            req = self.requests[chunk.seq.seq_id]
            if not req.scheduled_once:
                req.scheduled_once = True
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
        spans = _logit_rows(out, seq_chunks)
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
        self._choose(rows, logits)
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

    def _choose(self, rows: list[tuple[EngineRequest, int, ScheduledChunk]],
                logits: torch.Tensor) -> None:
        live: list[tuple[EngineRequest, int, tuple[int, ...]]] = []
        for req, i, chunk in rows:
            if req.lifecycle.state is State.PREFILLING:
                req.lifecycle.transition(State.DECODING)
                req.decode_started = self.clock()
                self._record(req, tr.PREFILL_COMPLETED, cache_len=req.num_computed_tokens)
            # G1: cancel -> deadline -> choose (C2: a step that finished after the cancel is discarded)
            if req.cancel_pending:
                req.cancel()
            elif req.deadline is not None and self.clock() >= req.deadline:
                self._finish(req, FinishReason.DEADLINE_EXCEEDED)
            elif req.processor.budget_spent:  # NOTE: a budget of 0: prefill only, no token
                self._finish(req, req.plan.budget_end)
            else:
                live.append((req, i, chunk.token_ids[chunk.num_tokens - chunk.num_draft:]))
        if not live:
            return
        sampling_rows: list[SamplingRow] = []
        ok: list[tuple[EngineRequest, int, tuple[int, ...], SamplingRow]] = []
        index: list[int] = []
        for req, i, drafts in live:
            try:  # NOTE: a verification samples 1 + k rows (coda.engine.speculative); under a
                # grammar only row 0 here, the others once the drafts before them are accepted
                base = self._row(req)
                # NOTE: no drafts (issue 22): row 0 is base itself, no call into the drafting
                sampled = [base] if req.grammar is not None or not drafts else verify_rows(
                    base, drafts, req.spec.forced if req.spec else (), self._vocab)
                sampling_rows.extend(sampled)
                ok.append((req, i, drafts, base))
                index.extend(range(i, i + len(sampled)))
            except Exception as exc:  # one broken grammar fails only its own request
                self._end_failed(req, exc)
        if not ok:
            return
        try:
            # NOTE: every row in order (a plain decode step): the logits themselves, not an
            # identical copy (the sampler never writes into its input)
            picked = logits if index == list(range(logits.shape[0])) else logits.index_select(
                0, torch.tensor(index, dtype=torch.long))
            decisions = self.sampler.sample(picked, sampling_rows)
        except Exception as exc:
            for req, _, _, _ in ok:
                self._end_failed(req, exc)
            return
        at = 0
        for req, i, drafts, base in ok:
            n = 1 if req.grammar is not None else 1 + len(drafts)
            dec, at = decisions[at], at + n
            if drafts:
                emit_verified(self, req, decisions[at - n:at], drafts, base, logits, i)
                continue
            if req.closer is not None:
                try:
                    dec = self._keep_closable(req, dec, logits[i:i + 1])
                except Exception as exc:  # NOTE: a closure fault fails only its own request
                    self._end_failed(req, exc)
                    continue
            self._on_decision(req, dec)

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
        return self.sampler.sample(logits.clone(), [self._row(req)])[0]

    @property
    def _vocab(self) -> int:
        return self.runner.config.vocab_size

    def _row(self, req: EngineRequest) -> SamplingRow:
        mask = req.grammar.allowed_mask() if req.grammar is not None else None
        if mask is not None and (opener := req.processor.opener_ids()):
            mask[list(opener)] = True  # NOTE: issue 23: the first token may open the block
        if req.closer is not None and req.closer.forcing:
            mask = req.closer.mask(self.runner.config.vocab_size)
        forced = req.processor.forced_token()
        if forced is not None:  # NOTE: issue 23: the reasoning budget closes the block exactly
            mask = torch.zeros(self.runner.config.vocab_size, dtype=torch.bool)
            mask[forced] = True
        # NOTE: the cursor's step is the number of output tokens (advanced in _on_decision;
        # kept across preemption and retries, so a recomputed step draws the same uniform)
        return SamplingRow(params=req.plan.sampling, seed=req.rng_seed, step=req.rng_step,
                           prompt_token_ids=req.prompt_token_ids,
                           output_token_ids=req.output_token_ids,
                           eos_token_ids=req.plan.eos_token_ids, allowed_token_ids_mask=mask)

    def _on_decision(self, req: EngineRequest, dec: TokenDecision) -> None:
        req.append_token(dec.token_id)
        req.rng_step = req.num_output_tokens
        if req.first_token_at is None:
            req.first_token_at = self.clock()
        if req.grammar is not None and dec.token_id in req.processor.opener_ids():
            req.hold_grammar()  # NOTE: issue 23: the block opens: the opener is not the answer's
        if req.grammar is not None and not req.grammar.consume(dec.token_id):
            self._end_failed(req, ModelError(f"grammar rejected token {dec.token_id}"))
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


def _logit_rows(out: SchedulerOutput, chunks: list[SeqChunk]
                ) -> list[tuple[int, ScheduledChunk, int]]:
    """Each chunk that has logits rows: the index of its first one and how many of them score
    prompt tokens (they come first; then a verification's ``1 + num_draft`` rows,
    coda.engine.speculative, or the one row of the next token)."""
    rows, at = [], 0
    for chunk, sc in zip(out.chunks, chunks, strict=True):
        if sc.need_logits:
            own = 1 + chunk.num_draft if chunk.need_logits else 0
            rows.append((at, chunk, sc.num_logits - own))
            at += sc.num_logits
    return rows
