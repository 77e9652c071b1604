"""The single-request reference loop of seed 000 §4.3 (SPEC G1–G3, T1–T3, C1–C3, E1).

It is the test oracle for the batched engine: same bytes, events and finish reasons. The
order of checks per step is exactly G1: cancel → deadline → choose → record → EOS →
detokenize → stop-match → emit → stop hit → max tokens → context limit → grammar termination →
decode_one. The middle of that list lives in :class:`coda.output.OutputProcessor`; this module
drives the model, observes cancel and deadline at safe points and ends the run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import tokenizers

from coda import trace as tr
from coda.errors import BackpressureOverflowError, CodaError, ModelError
from coda.finish import FinishReason
from coda.lifecycle import ResourceKind, State
from coda.output import EarlyStopHook, GrammarDone, OutputSpec
from coda.request import RequestRun
from coda.stream import RequestStream, TokenInfo
from coda.trace import NullTraceSink, TraceEvent, TraceSink


class Model(Protocol):
    """One request's model: ``prefill`` fills the cache with the prompt and returns the logits
    for y_1; ``decode_one`` appends y_t's K/V at ``position`` (= m+t-1) and returns the logits
    for y_{t+1} (T3). ``release`` frees the cache."""

    def prefill(self, token_ids: Sequence[int]) -> Any: ...
    def decode_one(self, token_id: int, position: int) -> Any: ...
    def release(self) -> None: ...


@dataclass(frozen=True)
class Choice:
    token_id: int
    info: TokenInfo
    decision: dict[str, Any] = field(default_factory=dict)
    confidence: float = 1.0


class Chooser(Protocol):
    """The ``choose`` step: logits for the prefix → the token y_t and its decision record."""

    def choose(self, logits: Any, step: int, output_ids: Sequence[int]) -> Choice: ...


def _nothing_held() -> dict[str, int]:
    return {"held": 0}


def generate(prompt_ids: Sequence[int], spec: OutputSpec, model: Model, chooser: Chooser,
             tokenizer: tokenizers.Tokenizer, *, request_id: str = "req-0",
             trace: TraceSink | None = None, stream: RequestStream | None = None,
             deadline: float | None = None, clock: Callable[[], float] = time.monotonic,
             model_name: str = "model", grammar_done: GrammarDone | None = None,
             early_stop: EarlyStopHook | None = None,
             on_created: Callable[[RequestRun], None] | None = None) -> RequestRun:
    """Run one request to its single terminal event and return its run.

    ``deadline`` is an absolute time on ``clock``. ``on_created`` receives the run before the
    first step, so a test (or a controller) can call ``run.request_cancel()`` at any moment.
    """
    # NOTE: one constructor; a bad stop (InvalidRequestError) raises before anything is held
    run = RequestRun(request_id, stream, trace if trace is not None else NullTraceSink(),
                     prompt_tokens=len(prompt_ids), output=spec, tokenizer=tokenizer,
                     prompt_token_ids=tuple(prompt_ids), grammar_done=grammar_done,
                     early_stop=early_stop)
    stream, sink, proc = run.stream, run.trace, run.processor
    assert proc is not None  # NOTE: built with the rules: this run selects tokens
    if on_created is not None:
        on_created(run)
    run.lifecycle.transition(State.QUEUED)
    stream.start(model_name)

    def record(kind: str, **data: Any) -> None:
        sink.record(TraceEvent(request_id, kind, data))

    # check_cancel_or_deadline() before prefill
    if run.cancel_pending:
        run.cancel()
        return run
    if deadline is not None and clock() >= deadline:
        run.finish(FinishReason.DEADLINE_EXCEEDED)
        return run

    run.lifecycle.transition(State.PREFILLING)
    run.prefill_started = time.monotonic()
    record(tr.PREFILL_STARTED, tokens=len(prompt_ids))
    run.acquire(ResourceKind.KV_CACHE, model.release)
    # NOTE: the reference loop runs one request with a stateless chooser: it has no batch row
    # and no RNG cursor to free. It still holds both kinds, so its ledger and trace match the
    # engine's (L7), and their release rows say honestly that nothing was held (held=0).
    run.acquire(ResourceKind.BATCH_SLOT, _nothing_held)
    run.acquire(ResourceKind.RNG_STATE, _nothing_held)
    try:
        logits = model.prefill(prompt_ids)
    except Exception as exc:
        run.fail(exc if isinstance(exc, CodaError) else ModelError(f"prefill failed: {exc!r}"))
        return run
    run.processed_prompt_tokens = len(prompt_ids)
    cache_len = len(prompt_ids)
    # NOTE: the transition first, as the engine writes it: prefill.completed is a DECODING row
    run.lifecycle.transition(State.DECODING)
    record(tr.PREFILL_COMPLETED, cache_len=cache_len)
    run.decode_started = time.monotonic()
    output: list[int] = []

    while True:
        if run.cancel_pending:  # safe point: observe the cancel (C1 moment 2)
            run.observe_cancel()
            break
        if deadline is not None and clock() >= deadline:  # G3: its own reason
            reason: FinishReason | None = FinishReason.DEADLINE_EXCEEDED
            break
        try:
            choice = chooser.choose(logits, len(output), output)
        except Exception as exc:
            run.fail(ModelError(f"choose failed: {exc!r}"))
            return run
        output.append(choice.token_id)
        if run.first_token_at is None:
            run.first_token_at = time.monotonic()
        try:
            reason = proc.on_token(choice.token_id, choice.info, choice.decision,
                                   choice.confidence)
        except BackpressureOverflowError as exc:  # P6 (3): past the bound, its own error
            run.fail(exc, FinishReason.TRANSPORT_ERROR)
            return run
        except Exception as exc:  # L7: never leave the run open with its resources held
            run.fail(exc if isinstance(exc, CodaError) else ModelError(f"step failed: {exc!r}"))
            return run
        if reason is not None:
            break  # T2: no further logits for a request that terminates here
        t = len(output)
        record(tr.DECODE_STARTED, t=t)
        try:
            logits = model.decode_one(choice.token_id, position=cache_len)
        except Exception as exc:
            run.fail(exc if isinstance(exc, CodaError) else ModelError(f"decode failed: {exc!r}"))
            return run
        cache_len += 1
        run.processed_output_tokens += 1
        record(tr.DECODE_COMPLETED, t=t, cache_len=cache_len)

    if run.lifecycle.state is State.CANCEL_REQUESTED:
        run.cancel()  # C2: whatever the in-flight step produced is discarded
        return run
    assert reason is not None
    run.conclude(reason)  # NOTE: an early stop takes the cancel path (D6)
    return run
