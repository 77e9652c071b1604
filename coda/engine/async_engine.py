"""The engine's public API: submit a request, iterate its events, cancel it
(SPEC P1–P3, C1, L2; issue 3 item 5).

The batch loop (:class:`~coda.engine.core.EngineCore`) runs on one daemon thread. ``submit``
validates synchronously (typed errors, nothing queued on failure) and returns a
:class:`RequestHandle` at once; its stream is the sequence-numbered log every reader replays.
What the engine is built with is derived in :mod:`coda.engine.engine_load`, what it says about
itself is :mod:`coda.engine.engine_report`, and its thread (start, loop, queued calls such as
embeddings, shutdown) is :mod:`coda.engine.engine_thread`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from pathlib import Path

from coda.early_stop import EarlyStopController
from coda.engine import engine_report, engine_thread
from coda.engine.closure import BudgetCloser
from coda.engine.core import EngineCore
from coda.engine.draft import Drafter
from coda.engine.embed_job import EmbedJob
from coda.engine.engine_load import (
    build_scheduler,
    load_parts,
    served_context,
    speculative_configs,
    trace_sink,
)
from coda.engine.engine_request import EngineRequest
from coda.engine.grammar import GrammarMatcher
from coda.engine.grammar_tokenizer import GrammarWarmup
from coda.engine.plan import ModelLimits, RequestPlan, plan_request
from coda.engine.protocol import InMemoryStreamLog, ModelInfo, RequestHandle
from coda.engine.runner import ModelRunner
from coda.engine.types import EngineConfig, EngineStats, GenerationRequest
from coda.errors import DuplicateRequestIdError, EngineNotStartedError, EngineShutdownError
from coda.finish import CancelCause
from coda.models.source import DEFAULT_MODEL_DIR as DEFAULT_MODEL_DIR
from coda.models.source import LoadedModel, model_key
from coda.models.tokenizer_bundle import TokenizerBundle
from coda.reader import follow
from coda.stream import StreamEvent
from coda.trace import TraceSink

# NOTE: a request checked by ``submit``: its plan, compiled grammar, closer and early stop
_Checked = tuple[RequestPlan, GrammarMatcher | None, BudgetCloser | None,
                 EarlyStopController | None]


class AsyncEngine:
    """A thread-backed engine: loads a model (HF folder, GGUF file or package) and runs the
    batch loop on one daemon thread; ``submit``, ``cancel`` and ``attach`` may be called from
    any thread (or an asyncio loop: they never block on the loop). The name is historical;
    it is not an asyncio engine. Implements :class:`coda.engine.protocol.Engine` in process."""

    def __init__(self, loaded: LoadedModel, runner: ModelRunner, config: EngineConfig, *,
                 trace: TraceSink | None = None, kv_reason: str = "",
                 load_s: float | None = None, rss_at_load: int | None = None,
                 drafter: Drafter | None = None, memory_budget: int | None = None) -> None:
        self.source = loaded.source
        self.model_dir = loaded.source.path
        self.loaded = loaded
        self.config = config
        self.runner = runner
        bundle: TokenizerBundle = loaded.bundle
        self.chat = bundle
        self.tokenizer = bundle.tokenizer
        self.model_name = config.served_model_name or loaded.source.name
        # NOTE: every name a client may send as ``model`` (issue 19 item 4), normalised
        self.model_aliases: frozenset[str] = loaded.source.aliases | {model_key(self.model_name)}
        # P1: the content identity of what produces the output (computed once, at load)
        self.identity = loaded.identity
        self.model_snapshot = self.identity.snapshot
        # NOTE: --max-model-len capped to the model's context and the context lowered to the
        # cache (issue 19 item 3), each None if not: said at load (coda.engine.engine_load)
        self.context_length: int
        self.context_capped_from: int | None
        self.context_lowered_from: int | None
        self.context_length, self.context_capped_from, self.context_lowered_from = \
            served_context(loaded, runner, config)
        self.eos_token_ids: frozenset[int] = bundle.eos_token_ids
        self.limits = ModelLimits(self.context_length, runner.config.vocab_size,
                                  self.eos_token_ids, config.max_stop_strings,
                                  config.max_stop_string_bytes, config.default_max_tokens)
        # NOTE: issue 21: a mode that cannot run exactly is refused here, before anything opens
        self.speculative, self.predicted = speculative_configs(loaded, runner, config, drafter)
        self.drafter = drafter  # NOTE: issue 21 item 2 (coda.engine.draft)
        self.kv_reason = kv_reason
        self.memory_budget = memory_budget  # NOTE: the budget that sized the caches, or None
        self.load_s, self.rss_at_load = load_s, rss_at_load  # NOTE: measured by from_model_dir
        self.trace = trace = trace if trace is not None else trace_sink(config)
        sched = build_scheduler(runner, config)
        self.core = EngineCore(runner, sched, self.tokenizer, trace,
                               max_forward_retries=config.max_forward_retries, drafter=drafter,
                               verify_costs=None if self.speculative is None
                               else self.speculative.costs)
        self._inbox: deque[EngineRequest] = deque()
        # NOTE: embeddings queued, the one running a chunk per loop turn (coda.engine.embed_job)
        self._calls: deque[EmbedJob] = deque()
        self._embedding: EmbedJob | None = None
        self.embed_chunks = self.embeds_cancelled = 0  # NOTE: chunks run, jobs dropped
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._at_exit: Callable[[], None] | None = None  # NOTE: set by start()
        self.grammar_warmup: GrammarWarmup | None = None  # NOTE: set by start()
        self._stopping = False
        self._ids = itertools.count(1)
        self.num_requests_total = 0
        self.step_error: BaseException | None = None
        self.idle_checks = 0  # NOTE: block-manager integrity checks run while idle
        self.idle_check_failures = 0
        self.log = InMemoryStreamLog()  # NOTE: what ``attach`` replays (P3)
        self._live: dict[str, RequestHandle] = {}  # NOTE: what ``cancel`` by id reaches
        self._live_lock = threading.Lock()
        self._sweep_at = 64
        # NOTE: issue 24 item 2: steps taken, and whether one runs now; each step's end is
        # posted to the wake-up channel with this engine as the source (a replica's feed
        # sends one message per step: coda.scaleout.feed)
        self.steps = 0
        self.stepping = False

    @classmethod
    def from_model_dir(cls, model: str | Path | None = None,
                       config: EngineConfig | None = None, *,
                       trace: TraceSink | None = None) -> AsyncEngine:
        """Load ``model`` (see :func:`coda.models.source.resolve_model`; None = the embedded
        model). Raises :class:`~coda.models.config.ModelLoadError` naming what is missing, and
        :class:`~coda.models.kernels.KernelIsaError` for a refused ``CODA_KERNEL_ISA``
        (:func:`coda.engine.engine_load.load_parts`)."""
        p = load_parts(model, config or EngineConfig())
        return cls(p.loaded, p.runner, p.config, trace=trace, kv_reason=p.kv_reason,
                   load_s=p.load_s, rss_at_load=p.rss_at_load, drafter=p.drafter,
                   memory_budget=p.kv_budget.budget.num_bytes
                   if p.kv_budget is not None and p.kv_budget.budget is not None else None)

    def describe(self) -> list[str]:
        """What was loaded, for the CLI to print at start (issue 9 items 1 and 4)."""
        return engine_report.describe(self)

    def load_summary(self) -> dict[str, str | int | float | bool]:
        """What was loaded as one flat record (``coda serve`` logs it as one JSON line, O1)."""
        return engine_report.summary(self)

    # -- lifecycle of the engine itself ----------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (once), with an at-exit shutdown and the grammar
        tokenizer's build (coda.engine.engine_thread)."""
        engine_thread.start(self)

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every in-flight request with a terminal event (cancelled, cause shutdown)."""
        engine_thread.shutdown(self, timeout)

    def __enter__(self) -> AsyncEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ----------------------------------------------------------------------------
    def _validate(self, req: GenerationRequest) -> _Checked:
        """Plan ``req`` (the one check, coda.engine.plan) and compile what it needs: every
        check that can reject it, before anything is acquired."""
        if self._stopping:
            raise EngineShutdownError("the engine is shutting down")
        # NOTE: issue 19 item 3: the plan's context check is also the cache's (the context is
        # lowered to the cache above): one the cache could never hold is refused here, a 4xx
        plan = plan_request(req, self.limits)
        grammar = self._grammar(plan)
        closer = self._closer(plan, grammar)
        controller = EarlyStopController(plan.early_stop) if plan.early_stop is not None else None
        return plan, grammar, closer, controller

    def _build(self, checked: _Checked) -> EngineRequest:
        plan, grammar, closer, controller = checked
        return EngineRequest(plan, next(self._ids), self.tokenizer, self.trace,
                             arrival=time.monotonic(), grammar=grammar, early_stop=controller,
                             closer=closer, speculative=self.speculative,
                             predicted=self.predicted,
                             model=self.model_name, model_snapshot=self.model_snapshot)

    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Validate and queue ``req``; raises InvalidRequestError (nothing queued) on bad input,
        DuplicateRequestIdError for the ``request_id`` of a request still running,
        EngineNotStartedError before :meth:`start`, EngineShutdownError once it shuts down."""
        return self.submit_all([req])[0]

    def submit_all(self, reqs: list[GenerationRequest]) -> list[RequestHandle]:
        """Validate every request, then queue them at once: the engine admits them in the same
        step (a crowd, as a batch of simultaneous arrivals). Raises as :meth:`submit` does,
        before anything is queued or opened if any request is refused."""
        checked = [self._validate(r) for r in reqs]
        if self._thread is None:  # NOTE: after validation, before anything is acquired
            raise EngineNotStartedError("the engine is not started: call engine.start() (or use "
                                        "`with engine:`) before submit")
        with self._live_lock:  # NOTE: the id check and the registration are one step
            self._refuse_live([c[0].request_id for c in checked])
            built = [self._build(c) for c in checked]
            handles = [self.log.open_handle(ereq, self._wake) for ereq in built]
            self._track(handles)
        with self._cond:
            self._inbox.extend(built)
            self.num_requests_total += len(built)
            self._cond.notify_all()
        return handles

    def embed_future(self, token_ids: list[int]) -> Future[list[float]]:
        """Queue an embedding of ``token_ids`` (the mean-pooled last hidden state) to run on
        the engine thread in chunks between steps (coda.engine.embed_job; cancel the future to
        stop it at its next chunk); raises InvalidRequestError (field ``input``) on an empty,
        too long or out-of-vocabulary input, EngineNotStartedError before :meth:`start`."""
        return engine_thread.embed_future(self, token_ids)

    async def embed(self, token_ids: list[int]) -> list[float]:
        """:meth:`embed_future`, awaited (the :class:`~coda.engine.protocol.Engine` seam); a
        cancelled await cancels the embedding."""
        return await asyncio.wrap_future(self.embed_future(token_ids))

    def _refuse_live(self, ids: list[str]) -> None:
        """DuplicateRequestIdError for an id of a request still running here (or twice in
        ``ids``): ``cancel`` and ``attach`` by id would reach only one of them. An ended
        request's id may be used again. Called with ``_live_lock`` held."""
        seen: set[str] = set()
        for rid in ids:
            running = self._live.get(rid)
            if rid in seen or (running is not None and not running.stream.closed):
                raise DuplicateRequestIdError(f"request id {rid!r} is already running",
                                              field="request_id")
            seen.add(rid)

    def _track(self, handles: list[RequestHandle]) -> None:
        """Keep ``handles`` (their streams registered in the log as they were opened)
        reachable by id for ``cancel``. Ended ones are dropped here, when the map has doubled
        since the last sweep (amortised O(1) per submit), and by ``cancel``: nothing observes
        the stream from the engine thread (issue 22 step 4). Called with ``_live_lock`` held."""
        for handle in handles:
            self._live[handle.request_id] = handle
        if len(self._live) >= self._sweep_at:
            for rid in [r for r, h in self._live.items() if h.stream.closed]:
                del self._live[rid]
            self._sweep_at = max(64, 2 * len(self._live))

    def attach(self, request_id: str, after_seq: int = -1) -> AsyncIterator[StreamEvent]:
        """Replay ``request_id``'s log after ``after_seq``, then follow it (P3); KeyError
        once the in-memory log has evicted it."""
        stream = self.log.stream(request_id)
        if stream is None:
            raise KeyError(request_id)
        return follow(stream, after_seq)

    def cancel(self, request_id: str, cause: CancelCause = CancelCause.CLIENT) -> bool:
        """Cancel a running request by id (C1); False if it is unknown or already ended."""
        with self._live_lock:
            handle = self._live.get(request_id)
            if handle is not None and handle.stream.closed:
                del self._live[request_id]
                return False
        return handle.cancel(cause) if handle is not None else False

    def model_info(self) -> ModelInfo:
        """The served model's card (coda.engine.engine_report)."""
        return engine_report.model_info(self)

    def _grammar(self, plan: RequestPlan) -> GrammarMatcher | None:
        if plan.grammar is None:
            return None
        from coda.engine.grammar import compile_grammar  # issue 5; imported lazily

        return compile_grammar(plan.grammar, self.tokenizer, self.runner.config.vocab_size,
                               self.eos_token_ids)

    def _closer(self, plan: RequestPlan, grammar: GrammarMatcher | None) -> BudgetCloser | None:
        """Issue 13: the request's closure state, or None. Raises InvalidRequestError naming
        max_tokens (through the plan) when even the shortest known completion of the compiled
        grammar does not fit the budget."""
        if grammar is None or not plan.closes_within_budget:
            return None
        closer = BudgetCloser(grammar, plan.max_tokens)
        path = closer.initial()
        if path is None:
            return None  # NOTE: no realizable completion from the start: closure off (closure.py)
        plan.require_budget(len(path), "the grammar: its shortest known completion needs")
        return closer

    def num_waiting(self) -> int:
        """Accepted requests a step has yet to admit, embeddings queued for the engine thread
        included (``stats().num_waiting``)."""
        return self.core.scheduler.num_waiting + len(self._inbox) + len(self._calls)

    def num_queued(self, incoming: int = 0) -> int:
        """Admission's count (:meth:`coda.engine.protocol.Engine.num_queued`): the generation
        requests not admitted yet, with ``incoming``, past the batch slots free; a queued
        embedding holds no slot and waits whatever they are."""
        sched = self.core.scheduler
        free = max(0, self.config.max_num_seqs - sched.num_running)
        pending = sched.num_waiting + len(self._inbox) + incoming
        return len(self._calls) + max(0, pending - free)

    def stats(self) -> EngineStats:
        """The engine's gauges now (coda.engine.engine_report)."""
        return engine_report.stats(self)

    # -- the engine thread (coda.engine.engine_thread) ---------------------------------------
    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()
