"""The engine's public API: submit a request, iterate its events, cancel it
(SPEC P1–P3, C1, L2; issue 3 item 5).

The batch loop (:class:`~coda.engine.core.EngineCore`) runs on one daemon thread. ``submit``
validates synchronously (typed errors, nothing queued on failure) and returns a
:class:`RequestHandle` at once; its stream is the sequence-numbered log every reader replays.
"""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import tokenizers

from coda.early_stop import EarlyStopController
from coda.engine.core import EngineCore, EngineRequest
from coda.engine.handle import RequestHandle
from coda.engine.kv_cache import BlockManager
from coda.engine.runner import ModelRunner
from coda.engine.scheduler import Scheduler, SchedulerConfig
from coda.engine.sequence import Sequence
from coda.engine.types import EngineConfig, EngineStats, GenerationRequest
from coda.errors import ContextLengthExceededError, InvalidRequestError
from coda.finish import CancelCause
from coda.lifecycle import ResourceKind
from coda.request import RequestRun
from coda.step import OutputProcessor, OutputSpec
from coda.stream import RequestStream
from coda.trace import JsonlTraceSink, NullTraceSink, RecentTraceSink, TraceSink

log = logging.getLogger("coda.engine")

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_model"


class AsyncEngine:
    """Loads a model folder, runs the batch loop on one thread, serves many requests."""

    def __init__(self, model_dir: Path, runner: ModelRunner, tokenizer: tokenizers.Tokenizer,
                 config: EngineConfig, *, trace: TraceSink | None = None) -> None:
        self.model_dir = model_dir
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = config.served_model_name or model_dir.name
        self.tokenizer_config: dict[str, Any] = _read_json(model_dir / "tokenizer_config.json")
        self.generation_config: dict[str, Any] = _read_json(model_dir / "generation_config.json")
        mc = runner.config
        self.context_length: int = mc.max_context
        self.eos_token_ids: frozenset[int] = _eos_ids(mc, self.generation_config, tokenizer,
                                                      self.tokenizer_config)
        if trace is None:
            trace = JsonlTraceSink(config.trace_path) if config.trace_path else NullTraceSink()
            if config.recent_traces > 0:
                trace = RecentTraceSink(config.recent_traces, inner=None if isinstance(
                    trace, NullTraceSink) else trace)
        self.trace = trace
        blocks = BlockManager(runner.num_blocks, runner.block_size,
                              enable_prefix_caching=config.enable_prefix_caching)
        sched = Scheduler(SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                          config.long_prefill_chunk, config.enable_prefix_caching),
                          blocks)
        self.core = EngineCore(runner, sched, tokenizer, trace,
                               max_forward_retries=config.max_forward_retries)
        self._inbox: deque[EngineRequest] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count(1)
        self.num_requests_total = 0
        self.step_error: BaseException | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path | None = None,
                       config: EngineConfig | None = None, *,
                       trace: TraceSink | None = None) -> AsyncEngine:
        config = config or EngineConfig()
        path = Path(model_dir) if model_dir is not None else DEFAULT_MODEL_DIR
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json (not an HF model folder)")
        runner = ModelRunner.from_dir(path, dtype=config.dtype, device=config.device,
                                      block_size=config.block_size, num_blocks=config.num_blocks,
                                      kv_cache_bytes=config.kv_cache_bytes)
        tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        return cls(path, runner, tok, config, trace=trace)

    # -- lifecycle of the engine itself ----------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="coda-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every in-flight request with a terminal event (cancelled, cause shutdown)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._abort_everything()

    def __enter__(self) -> AsyncEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> RequestHandle:
        """Validate and queue ``req``; raises InvalidRequestError (nothing queued) on bad input."""
        if self._stopping:
            raise InvalidRequestError("the engine is shutting down", field=None)
        prompt = tuple(req.prompt_token_ids)
        spec, max_tokens = self._output_spec(req, prompt)
        # NOTE: everything that can reject the request runs before any resource is acquired
        grammar = self._grammar(req)
        closer = self._closer(req, grammar, max_tokens)
        controller = EarlyStopController(req.early_stop) if req.early_stop is not None else None
        rid = req.request_id or f"req-{uuid.uuid4().hex[:16]}"
        stream = RequestStream(rid, req.backpressure)
        run = RequestRun(rid, stream, self.trace, prompt_tokens=len(prompt))
        run.acquire(ResourceKind.STREAM_BUFFER, lambda: None)
        run.acquire(ResourceKind.TRACE_HANDLE, lambda: None)
        seq = Sequence(next(self._ids), list(prompt), len(prompt) + max_tokens)
        seed = req.sampling.seed if req.sampling.seed is not None else secrets.randbits(63)
        proc = OutputProcessor(rid, self.tokenizer, spec, stream, self.trace,
                               prompt_token_ids=prompt,
                               grammar_done=(closer.done if closer is not None else
                                             grammar.is_terminated if grammar is not None
                                             else None),
                               early_stop=_early_stop_hook(controller, run, grammar),
                               grammar_budget_end=closer.budget_end if closer is not None
                               else None)
        run.processor = proc
        deadline = time.monotonic() + req.deadline_s if req.deadline_s is not None else None
        ereq = EngineRequest(seq, run, proc, seed, self.eos_token_ids, req.sampling, deadline,
                             req.sampling.logprobs is not None, grammar, controller, closer)
        stream.start(self.model_name)
        with self._cond:
            self._inbox.append(ereq)
            self.num_requests_total += 1
            self._cond.notify_all()
        return RequestHandle(run, self._wake)

    def _output_spec(self, req: GenerationRequest, prompt: tuple[int, ...]) -> tuple[OutputSpec, int]:
        vocab = self.runner.config.vocab_size
        if not prompt:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", field="prompt")
        room = self.context_length - len(prompt)
        if room <= 0:
            raise ContextLengthExceededError(
                f"the prompt has {len(prompt)} tokens; this model's context is "
                f"{self.context_length} tokens", field="prompt")
        if req.max_tokens is not None and (isinstance(req.max_tokens, bool) or req.max_tokens < 1):
            raise InvalidRequestError("max_tokens must be an integer >= 1", field="max_tokens")
        if req.max_tokens is not None and req.max_tokens > room:
            raise ContextLengthExceededError(
                f"prompt ({len(prompt)}) + max_tokens ({req.max_tokens}) exceeds the context "
                f"({self.context_length})", field="max_tokens")
        capacity = self.runner.num_blocks * self.runner.block_size
        # NOTE: no max_tokens means "as far as the context and the whole KV cache allow"
        max_tokens = req.max_tokens or min(room, capacity - len(prompt))
        if len(prompt) + max_tokens > capacity or max_tokens < 1:
            raise InvalidRequestError(
                f"prompt + max_tokens ({len(prompt) + max_tokens}) exceeds the KV cache "
                f"({capacity} tokens)", field="max_tokens")
        cfg = self.config
        if len(req.stop) > cfg.max_stop_strings:
            raise InvalidRequestError(f"at most {cfg.max_stop_strings} stop strings", field="stop")
        for s in req.stop:
            if not s or len(s.encode()) > cfg.max_stop_string_bytes:
                raise InvalidRequestError(
                    f"each stop string must be 1..{cfg.max_stop_string_bytes} bytes", field="stop")
        for ids in req.stop_token_ids:
            if not ids or any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError("stop_token_ids must be non-empty sequences of valid ids",
                                          field="stop_token_ids")
        req.sampling.validate_for_vocab(vocab)
        if req.deadline_s is not None and not req.deadline_s > 0:
            raise InvalidRequestError("deadline must be > 0 seconds", field="deadline")
        spec = OutputSpec(
            max_output_tokens=max_tokens, context_limit=self.context_length,
            prompt_len=len(prompt), eos_token_ids=self.eos_token_ids,
            ignore_eos=req.sampling.ignore_eos, stop_strings=tuple(req.stop),
            stop_token_ids=tuple(tuple(s) for s in req.stop_token_ids),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            stops_end_at=(req.stops_end_at or "").encode())
        return spec, max_tokens

    def _grammar(self, req: GenerationRequest) -> Any:
        if req.grammar is None:
            return None
        from coda.engine.grammar import compile_grammar  # issue 5; imported lazily

        return compile_grammar(req.grammar, self.tokenizer, self.runner.config.vocab_size,
                               self.eos_token_ids)

    def _closer(self, req: GenerationRequest, grammar: Any, max_tokens: int) -> Any:
        """Issue 13: the request's closure state, or None. Raises InvalidRequestError naming
        max_tokens when even the shortest known completion does not fit the budget."""
        if grammar is None or req.grammar is None or not req.grammar.closes_within_budget:
            return None
        from coda.engine.closure import BudgetCloser

        closer = BudgetCloser(grammar, max_tokens)
        path = closer.initial()
        if path is None:
            return None  # NOTE: no realizable completion from the start: closure off (closure.py)
        if len(path) > max_tokens:
            raise InvalidRequestError(
                f"max_tokens ({max_tokens}) is too small for the grammar: its shortest known "
                f"completion needs {len(path)} tokens", field="max_tokens")
        return closer

    def stats(self) -> EngineStats:
        bm = self.core.scheduler.block_manager
        return EngineStats(
            num_running=self.core.scheduler.num_running,
            num_waiting=self.core.scheduler.num_waiting + len(self._inbox),
            kv_cache_usage=bm.usage, num_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks, num_requests_total=self.num_requests_total,
            num_preemptions_total=self.core.num_preemptions_total)

    # -- the engine thread -----------------------------------------------------------------
    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._inbox and not self.core.has_work:
                    self._cond.wait(0.5)
                if self._stopping:
                    return
                incoming = list(self._inbox)
                self._inbox.clear()
            for ereq in incoming:
                self._admit(ereq)
            try:
                if self.core.step() == 0:
                    with self._cond:  # nothing runnable (paused / out of blocks): don't spin
                        self._cond.wait(0.005)
            except Exception as exc:  # a bug in the engine itself: fail everyone, keep serving
                log.exception("engine step failed")
                self.step_error = exc
                self.core.abort_all(CancelCause.SHUTDOWN)

    def _admit(self, ereq: EngineRequest) -> None:
        try:
            self.core.add(ereq)
        except InvalidRequestError as exc:
            ereq.run.fail(exc)

    def _abort_everything(self) -> None:
        with self._cond:
            incoming = list(self._inbox)
            self._inbox.clear()
        for ereq in incoming:
            self._admit(ereq)
        self.core.abort_all(CancelCause.SHUTDOWN)


def _early_stop_hook(controller: EarlyStopController | None, run: RequestRun,
                     grammar: Any) -> Any:
    if controller is None:
        return None
    from coda.engine.early_stop_hook import make_hook  # issue 5

    return make_hook(controller, run, grammar)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _eos_ids(mc: Any, gen: dict[str, Any], tok: tokenizers.Tokenizer,
             tok_cfg: dict[str, Any]) -> frozenset[int]:
    ids: set[int] = set()
    for src in (gen.get("eos_token_id"), getattr(mc, "eos_token_ids", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, list | tuple | frozenset | set):
            ids.update(int(i) for i in src)
    eos = tok_cfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    eos_id = tok.token_to_id(eos) if isinstance(eos, str) else None
    if eos_id is not None:
        ids.add(eos_id)
    return frozenset(ids)
