"""The engine's one live object per request (issue 22; SPEC L7, T4): :class:`EngineRequest`,
built once at ``submit`` from the checked plan and its parts, then moved by the engine thread
(:mod:`coda.engine.core`) until its lifecycle releases everything it holds."""

from __future__ import annotations

from collections.abc import Mapping

import tokenizers
import torch

from coda.early_stop import EarlyStopController
from coda.engine.closure import BudgetCloser
from coda.engine.early_stop_hook import make_hook
from coda.engine.grammar import GrammarMatcher
from coda.engine.plan import RequestPlan
from coda.engine.prediction import prediction_counts as count_prediction
from coda.engine.sampler import SamplingRow
from coda.engine.sequence import Sequence
from coda.engine.speculative import SpeculativeConfig, state_for
from coda.errors import ErrorCode
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.output import OutputProcessor
from coda.request import RequestRun
from coda.trace import TraceSink


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
        # start event for ``model``, unless that waits for admission), trace handle,
        # processor and its hooks, in one call
        self.unstarted: tuple[str, str | None] | None = None
        if plan.start_at_admission and model is not None:
            self.unstarted, model = (model, model_snapshot), None
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

    def open_stream(self) -> None:
        """P1: the start event a ``start_at_admission`` request waits with, appended once: at
        admission (its first prefill chunk scheduled, coda.engine.core), or before an ending
        that comes first (cancelled or refused while queued), so start is still event 0."""
        if self.unstarted is not None:
            (model, snapshot), self.unstarted = self.unstarted, None
            self.stream.start(model, snapshot)

    def _end(self, state: State, reason: FinishReason, code: ErrorCode | None = None,
             message: str | None = None) -> None:
        self.open_stream()  # NOTE: the terminal reads the start's snapshot (P1, P2)
        super()._end(state, reason, code, message)

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

    def sampling_row(self, vocab_size: int) -> SamplingRow:
        """The row this request's next token is drawn with (every sampling call reads one):
        its sampling parameters, RNG cursor, token history and the mask of what it may draw
        (the grammar's, the closer's path, or the reasoning budget's forced closer)."""
        mask = self.grammar.allowed_mask() if self.grammar is not None else None
        if mask is not None and (opener := self.processor.opener_ids()):
            mask[list(opener)] = True  # NOTE: issue 23: the first token may open the block
        if self.closer is not None and self.closer.forcing:
            mask = self.closer.mask(vocab_size)
        forced = self.processor.forced_token()
        if forced is not None:  # NOTE: issue 23: the reasoning budget closes the block exactly
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[forced] = True
        # NOTE: the cursor's step is the number of output tokens (advanced in _on_decision;
        # kept across preemption and retries, so a recomputed step draws the same uniform)
        return SamplingRow(params=self.plan.sampling, seed=self.rng_seed, step=self.rng_step,
                           prompt_token_ids=self.prompt_token_ids,
                           output_token_ids=self.output_token_ids,
                           eos_token_ids=self.plan.eos_token_ids, allowed_token_ids_mask=mask)

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

    def note_preempted(self) -> None:
        """T4, O1: the scheduler dropped this request's K/V to make room (recompute later):
        its ``kv.preempted`` row, with the selected count and the tokens and blocks dropped."""
        tokens, blocks = self.dropped
        self.lifecycle.preempt({"t": self.num_output_tokens, "cache_len": tokens,
                                "blocks": blocks, "preemption": self.num_preemptions})

    def note_reacquired(self, start_pos: int) -> None:
        """T4, O1: its first chunk after a preemption: the ``kv.reacquired`` row, with the
        tokens the re-prefill recomputes (prompt and outputs past the prefix cache's
        ``start_pos`` reused ones)."""
        self.lifecycle.reacquire({"t": self.num_output_tokens,
                                  "recompute": self.num_tokens - start_pos, "cached": start_pos})
