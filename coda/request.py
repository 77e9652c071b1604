"""One request's run: lifecycle, resources, stream and the terminal, in one place
(SPEC L1–L7, C1–C3, G3, P1, P5, O1).

Both drivers — the reference loop (``tests/reference_loop.py``, the engine's test oracle) and
the batched engine — hold one :class:`RequestRun` per request, which builds its own parts
(stream, trace handle, output processor and its grammar/early-stop hooks, in its one
constructor; nothing is attached later): the loop a plain run, the engine its own
subclass (:class:`coda.engine.engine_request.EngineRequest`, the engine's one live object per request),
and end it through exactly one of :meth:`finish`,
:meth:`fail` or :meth:`cancel`. Each releases the model resources and then fixes the terminal
state and queues the terminal event inside the lifecycle's critical section (L2); the
terminal row is written there too, and the stream buffer and the trace handle are released
after it, all before the queued terminal event is published to the stream's readers: whoever
sees a request's end (a client, ``RequestHandle.wait``, ``GET /v1/traces/{id}`` after it)
finds its trace sealed (O1, L7).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

import tokenizers

from coda import trace as tr
from coda.errors import BackpressureOverflowError, CodaError, DecodingError, ErrorCode
from coda.finish import CancelCause, FinishReason, PhaseTimes, Terminal, Usage
from coda.lifecycle import Lifecycle, Release, ResourceKind, State
from coda.output import EarlyStopHook, GrammarBudgetEnd, GrammarDone, OutputProcessor, OutputSpec
from coda.stream import RequestStream, TokenInfo
from coda.stream_backpressure import BackpressureConfig
from coda.trace import TraceHandle, TraceSink

MODEL_RESOURCES = (ResourceKind.KV_CACHE, ResourceKind.BATCH_SLOT, ResourceKind.RNG_STATE)
STREAM_RESOURCES = (ResourceKind.STREAM_BUFFER, ResourceKind.TRACE_HANDLE)


class RequestRun:
    """Lifecycle (state and resources) + stream + output processor + trace handle of one
    request, built once (issue 11 item 2): nothing is attached after construction. Thread-safe where it must be:
    :meth:`request_cancel` may be called from any thread; everything else from the driver.

    Construction acquires the two resources every request holds from its first moment: the
    stream buffer (live delivery and backpressure credit) and the trace handle; the driver
    acquires the model resources (KV cache, batch slot, RNG state) when it admits the request.
    Both drivers pass the per-token rules (``output``, with the ``tokenizer``, the prompt and
    the hooks) and the run builds its stream (unless given), trace handle and output
    processor itself, in that order, before the lifecycle holds anything (a bad stop raises
    InvalidRequestError first). ``processor``: one built by the caller (tests of the
    processor); None with no ``output`` only for runs that never select a token (tests of the
    lifecycle)."""

    def __init__(self, request_id: str, stream: RequestStream | None, trace: TraceSink,
                 processor: OutputProcessor | None = None, *, prompt_tokens: int,
                 arrival: float | None = None, output: OutputSpec | None = None,
                 tokenizer: tokenizers.Tokenizer | None = None,
                 prompt_token_ids: tuple[int, ...] = (),
                 backpressure: BackpressureConfig | None = None,
                 grammar_done: GrammarDone | None = None,
                 grammar_budget_end: GrammarBudgetEnd | None = None,
                 early_stop: EarlyStopHook | None = None, model: str | None = None,
                 model_snapshot: str | None = None) -> None:
        self.request_id = request_id
        # NOTE: the stream is built here unless given (with the request's backpressure), and
        # with ``model`` it opens with its start event (P1) as it is built
        self.stream = stream = (stream if stream is not None
                                else RequestStream(request_id, backpressure, model=model,
                                                   model_snapshot=model_snapshot))
        # NOTE: a handle passed in (shared with a processor built elsewhere) is kept as it is
        self.trace = trace if isinstance(trace, TraceHandle) else TraceHandle(trace, request_id)
        self.prompt_tokens = prompt_tokens
        if output is not None:
            # NOTE: the one constructor of the parts both drivers use (issue 22): with the
            # per-token rules, the processor is built here, holding this stream and handle and
            # the grammar / early-stop hooks; a bad stop raises before anything is held
            if processor is not None or tokenizer is None:
                raise TypeError("RequestRun: output= builds the processor from tokenizer=; "
                                "pass a tokenizer and no processor")
            processor = OutputProcessor(request_id, tokenizer, output, stream, self.trace,
                                        prompt_token_ids=prompt_token_ids,
                                        grammar_done=grammar_done, early_stop=early_stop,
                                        grammar_budget_end=grammar_budget_end)
        self._processor = processor  # NOTE: fixed at construction (read-only property)
        # NOTE: one object for the state and the resources (L2, L7), writing its own rows;
        # born holding the stream buffer and the trace handle
        self.lifecycle = Lifecycle(request_id, self.trace, {
            ResourceKind.STREAM_BUFFER: stream.release_live,
            ResourceKind.TRACE_HANDLE: self.trace.close})
        self.cancel_cause: CancelCause | None = None
        self.cancel_requested_at: float | None = None
        self.cancel_observed_at: float | None = None
        self.cancel_effective_at: float | None = None
        # P5 timings
        self.arrival = arrival if arrival is not None else time.monotonic()
        self.prefill_started: float | None = None
        self.decode_started: float | None = None
        self.first_token_at: float | None = None
        self.ended_at: float | None = None
        # L6 counters the driver maintains
        self.cached_prompt_tokens = 0
        self.processed_prompt_tokens = 0
        self.processed_output_tokens = 0
        # issue 21: the speculative counts the driver keeps (None: the request did not draft)
        self.speculative: Mapping[str, int] | None = None
        # echo: the prompt tokens the driver scored (coda.engine.core; empty: none asked)
        self.prompt_logprobs: list[TokenInfo] = []
        self._early_reason: FinishReason | None = None  # D6: an early stop's own reason

    @property
    def processor(self) -> OutputProcessor | None:
        return self._processor

    def prediction_counts(self) -> Mapping[str, int] | None:
        """A chat prediction's accepted / rejected tokens against the output, for the
        terminal (None: no prediction; the engine's request computes them)."""
        return None

    # -- resources -------------------------------------------------------------------------
    def acquire(self, kind: ResourceKind, release: Release) -> None:
        self.lifecycle.acquire(kind, release)

    # -- cancellation (C1) -----------------------------------------------------------------
    def request_cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        """Moment 1 of C1: record the request; the driver observes it at its next safe point.
        Returns False, recording nothing, when it is late: the request is terminal or DRAINING
        (which ends FINISHED or FAILED), or a cancel was already requested. The check and the
        trace row happen in the lifecycle's critical section, so a racing terminal is either
        after the row or makes this return False (L2, O1)."""

        def note(state: State) -> bool:
            if state is State.DRAINING or self.cancel_cause is not None:
                return False
            self.cancel_cause = cause
            self.cancel_requested_at = time.monotonic()
            self._record(tr.CANCEL_REQUESTED, cause=cause.value)
            return True

        return self.lifecycle.while_live(note)

    @property
    def cancel_pending(self) -> bool:
        return self.cancel_cause is not None and not self.lifecycle.is_terminal

    def observe_cancel(self) -> bool:
        """Moment 2 of C1 at a safe point: mark CANCEL_REQUESTED. False if it lost a race."""
        if not self.lifecycle.try_transition(State.CANCEL_REQUESTED):
            return False
        self.cancel_observed_at = time.monotonic()
        self._record(tr.CANCEL_OBSERVED)
        return True

    @property
    def early_stop_summary(self) -> Mapping[str, object] | None:
        """seed 004: the early-stop policy's last decision (committed tokens, saved bound)."""
        return self.processor.early_stop_summary if self.processor is not None else None

    # -- the three endings -----------------------------------------------------------------
    def conclude(self, reason: FinishReason) -> None:
        """The loop decided to end after a token: an early-stop policy's stop takes the cancel
        path (:meth:`stop_early`, D6), every other reason the normal drain (:meth:`finish`)."""
        if self.processor is not None and self.processor.stopped_early:
            self.stop_early(reason)
        else:
            self.finish(reason)

    def stop_early(self, reason: FinishReason) -> None:
        """D6 (seed 004): the policy decided to stop; closing is the cancellation path. The
        three C1 moments happen at once; the pending tail and held stop bytes are discarded,
        ``finish()`` is not called, and the request ends CANCELLED with the policy's reason
        (confidence_stop, max_output_tokens, deadline_exceeded or cancelled). A cancel
        requested earlier keeps its own cause and reason."""
        if self.lifecycle.is_terminal:
            return

        def note(state: State) -> bool:
            if self.cancel_cause is not None:  # NOTE: an earlier cancel keeps its own cause
                return False
            self.cancel_cause = CancelCause.EARLY_STOP
            self.cancel_requested_at = time.monotonic()
            self._early_reason = reason
            self._record(tr.CANCEL_REQUESTED, cause=CancelCause.EARLY_STOP.value,
                         reason=reason.value)
            return True

        self.lifecycle.while_live(note)
        self.cancel()

    def finish(self, reason: FinishReason) -> FinishReason:
        """Normal end: DRAINING → drain → release → FINISHED(reason) (seed §4.3).
        A decoding error in the drain ends the request FAILED instead (K3)."""
        self.lifecycle.transition(State.DRAINING)
        if self.processor is not None:
            try:
                reason = self.processor.drain(reason)
            except CodaError as exc:  # K3 decoding error, or P6 overflow while draining
                # NOTE: a decoding error keeps the reason the loop stopped for (the model did
                # nothing wrong; the tail could not form text): FAILED, error decoding_error.
                failed = (FinishReason.TRANSPORT_ERROR if isinstance(exc, BackpressureOverflowError)
                          else reason if isinstance(exc, DecodingError) else FinishReason.MODEL_ERROR)
                self._end(State.FAILED, failed, exc.code, exc.message)
                return failed
        self._end(State.FINISHED, reason)
        return reason

    def fail(self, exc: BaseException, reason: FinishReason = FinishReason.MODEL_ERROR) -> None:
        code = exc.code if isinstance(exc, CodaError) else ErrorCode.MODEL_ERROR
        if self.processor is not None:
            self.processor.discard()
        self._end(State.FAILED, reason, code, str(exc))

    def cancel(self) -> None:
        """Moment 3 of C1: no more model steps; release at the safe point; CANCELLED."""
        if self.lifecycle.state is not State.CANCEL_REQUESTED:
            self.observe_cancel()
        if self.processor is not None:
            self.processor.discard()
        self.lifecycle.release_all(MODEL_RESOURCES)
        self.cancel_effective_at = time.monotonic()
        self._record(tr.CANCEL_EFFECTIVE)
        cause = self.cancel_cause or CancelCause.CLIENT
        reason = self._early_reason if cause is CancelCause.EARLY_STOP else None
        self._end(State.CANCELLED, reason or cause.finish_reason)

    # -- internals -------------------------------------------------------------------------
    def _end(self, state: State, reason: FinishReason, code: ErrorCode | None = None,
             message: str | None = None) -> None:
        self.ended_at = time.monotonic()
        self.lifecycle.release_all(MODEL_RESOURCES)
        proc = self.processor
        terminal = Terminal(
            state=state, finish_reason=reason, usage=self.usage(), error_code=code,
            error_message=message, stop=proc.hit if proc is not None else None,
            **self.timings(),
            trailing_tokens=proc.trailing_tokens() if proc is not None else (),
            trailing_shown=proc.trailing_shown if proc is not None else 0,
            early_stop=self.early_stop_summary,
            dropped_tail=proc.dropped_tail if proc is not None else b"",
            model_snapshot=self.stream.model_snapshot,
            reasoning=proc.reasoning_split() if proc is not None else None,
            speculative=dict(self.speculative) if self.speculative is not None else None,
            prompt_logprobs=tuple(self.prompt_logprobs),
            prediction=self.prediction_counts())

        closed: list[int] = []  # NOTE: this call's terminal seq, once it closed the stream

        def emit() -> None:
            # NOTE: the event is fixed (its seq) and queued here, in the critical section
            # (L2); readers see it at publish, after the row and the releases below (O1)
            closed.append(self.stream.close(terminal, hold=True).seq)
            self._record(tr.TERMINAL, seq=closed[0], state=state.value, reason=reason.value,
                         error=code.value if code else None, usage=terminal.usage.to_dict(),
                         dropped_tail_hex=terminal.dropped_tail.hex(),
                         finish_reason_version=terminal.finish_reason_version,
                         stop_rule_version=terminal.stop_rule_version)

        try:
            if self.lifecycle.terminate(state, emit):
                self.lifecycle.release_all(STREAM_RESOURCES)
        finally:
            if closed:  # NOTE: a failed row never leaves the readers waiting; a race's loser
                self.stream.publish()  # never publishes the winner's terminal early

    def usage(self) -> Usage:
        proc = self.processor
        return Usage(
            prompt_tokens=self.prompt_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            selected_tokens=proc.generated if proc else 0,
            processed_prompt_tokens=self.processed_prompt_tokens,
            processed_output_tokens=self.processed_output_tokens,
            returned_tokens=proc.returned_tokens if proc else 0,
            returned_bytes=proc.emitted_bytes if proc else 0,
        )

    def live_usage(self) -> Usage:
        """:meth:`usage` read from another thread while the driver runs: every count is at
        least what the stream's events so far show, and the returned bytes and tokens are one
        pair as of the same delta (the processor's ``sent_mark``). A model worker reports it
        so its parent bills a request the worker died under (coda.engine.process_engine)."""
        proc = self.processor
        mark = proc.sent_mark if proc else (0, 0)
        return replace(self.usage(), returned_tokens=mark[1], returned_bytes=mark[0])

    def timings(self) -> PhaseTimes:
        """The P5 phase times so far (the terminal's ``*_s`` fields at the end)."""
        end = self.ended_at or time.monotonic()
        pre, dec = self.prefill_started, self.decode_started
        return PhaseTimes(
            queue_s=((pre or end) - self.arrival),
            prefill_s=((dec or end) - pre) if pre is not None else 0.0,
            decode_s=(end - dec) if dec is not None else 0.0,
            stop_buffer_s=self.processor.stop_buffer_s if self.processor else 0.0,
            first_token_s=(self.first_token_at - self.arrival) if self.first_token_at else None,
            total_s=end - self.arrival,
        )

    def _record(self, kind: str, **data: object) -> None:
        self.lifecycle.record(kind, data)  # NOTE: after the lifecycle's birth rows
