"""How a RequestRun ends, seen from outside (issue 8, mutation survivors of coda/request.py):
the early-stop cancel path (D6, C1), an earlier cancel keeping its cause, what ``finish``
returns (L4, K3, P6), failures with held output (L7, P5), and the counters and timings of a
run that is still live or never reached the model (L6, P5). Through the reference loop on a
scripted model, or a RequestRun driven by hand where the loop ignores a return value.
"""

from __future__ import annotations

import time

import pytest

from coda import trace as tr
from coda.errors import ErrorCode
from coda.finish import CancelCause, FinishReason, PhaseTimes, Usage
from coda.lifecycle import State
from coda.output import EarlyStopHook, EarlyStopVerdict, OutputProcessor, OutputSpec
from coda.request import MODEL_RESOURCES, RequestRun
from coda.stream import RequestStream, TokenInfo
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy
from coda.trace import ListTraceSink, check_trace
from tests.reference_loop import generate
from tests.scripted import (
    EOS_ID,
    ManualClock,
    ScriptedChooser,
    ScriptedModel,
    TickingModel,
    output_spec,
    scripted_tokenizer,
)

TABLE = {101: b"AB", 102: b"CD", 103: b"EF", 107: b"x"}
TOK = scripted_tokenizer(TABLE)


_spec = output_spec


def _stop_at(n_stop: int, reason: FinishReason, box: list[RequestRun] | None = None,
             cancel_first: bool = False) -> EarlyStopHook:
    def policy(n: int, conf: float) -> EarlyStopVerdict:
        if n == n_stop and cancel_first and box:
            box[0].request_cancel()
        return EarlyStopVerdict(reason if n == n_stop else None, {"n": n})
    return policy


# ---------------------------------------------------------------------------------- D6
@pytest.mark.parametrize("reason", [FinishReason.CONFIDENCE_STOP, FinishReason.DEADLINE_EXCEEDED])
def test_d6_c1_early_stop_takes_the_cancel_path_with_the_policys_reason(
        reason: FinishReason) -> None:
    """D6, C1: the policy's stop runs the three C1 moments at once (requested with cause
    early_stop and the reason, observed, effective), discards the held stop prefix, and ends
    CANCELLED with the policy's own reason; every resource is released once."""
    sink = ListTraceSink()
    run = generate([1, 2], _spec(stop_strings=("DX",)), ScriptedModel([101, 102, 103, EOS_ID]),
                   ScriptedChooser(), TOK, trace=sink, early_stop=_stop_at(2, reason))
    assert check_trace(sink.events) == []
    t = run.stream.terminal
    assert t is not None and t.state is State.CANCELLED and t.finish_reason is reason
    assert run.stream.text() == "ABC" and run.cancel_cause is CancelCause.EARLY_STOP
    req = [e.data for e in sink.events if e.kind == tr.CANCEL_REQUESTED]
    assert req == [{"cause": "early_stop", "reason": reason.value}]
    kinds = sink.kinds()
    assert kinds.index(tr.CANCEL_REQUESTED) < kinds.index(tr.CANCEL_OBSERVED) \
        < kinds.index(tr.CANCEL_EFFECTIVE) < kinds.index(tr.TERMINAL)
    assert run.cancel_requested_at is not None and run.cancel_effective_at is not None
    assert run.cancel_requested_at <= run.cancel_effective_at
    assert run.lifecycle.held == frozenset() and len(run.lifecycle.released) == 5
    # O1: the run, its handle and every row name the one request
    assert run.request_id == run.trace.request_id == "req-0"  # NOTE: the loop's default id
    assert {e.request_id for e in sink.events} == {"req-0"}
    # a late stop_early on a terminal run changes nothing: no row (not even one the sealed
    # handle drops), no new cancel or end time
    n, effective, ended = len(sink.events), run.cancel_effective_at, run.ended_at
    run.stop_early(FinishReason.CONFIDENCE_STOP)
    assert len(sink.events) == n and run.stream.terminal is t
    assert run.trace.late_rows == 0
    assert run.cancel_effective_at == effective and run.ended_at == ended


def test_d6_c1_an_earlier_cancel_keeps_its_own_cause_and_reason() -> None:
    """D6, C1: a client cancel requested before the policy's stop keeps its cause: the run
    ends CANCELLED/cancelled, and no early-stop cancel row is written."""
    sink = ListTraceSink()
    box: list[RequestRun] = []
    run = generate([1, 2], _spec(), ScriptedModel([101, 102, 103, EOS_ID]), ScriptedChooser(),
                   TOK, trace=sink, on_created=box.append,
                   early_stop=_stop_at(2, FinishReason.CONFIDENCE_STOP, box, cancel_first=True))
    t = run.stream.terminal
    assert t is not None and t.state is State.CANCELLED
    assert t.finish_reason is FinishReason.CANCELLED and run.cancel_cause is CancelCause.CLIENT
    assert [e.data["cause"] for e in sink.events if e.kind == tr.CANCEL_REQUESTED] == ["client"]


def test_c1_cancel_releases_model_resources_before_it_is_effective() -> None:
    """C1 moment 3: the model's resources are released at the safe point, before the
    cancel.effective row; the stream resources after the terminal (L2)."""
    sink = ListTraceSink()
    box: list[RequestRun] = []

    def cancel() -> None:
        box[0].request_cancel()

    model = ScriptedModel([101, 102, 103], hooks={1: cancel})
    generate([1, 2], _spec(), model, ScriptedChooser(), TOK, trace=sink, on_created=box.append)
    rel = [i for i, e in enumerate(sink.events) if e.kind == tr.RESOURCE_RELEASED
           and e.data["resource"] in {k.value for k in MODEL_RESOURCES}]
    eff = sink.kinds().index(tr.CANCEL_EFFECTIVE)
    assert len(rel) == 3 and max(rel) < eff


# ----------------------------------------------------------------------- L4, K3, P6
def _by_hand(stream: RequestStream, spec: OutputSpec, script: list[int]
             ) -> tuple[RequestRun, OutputProcessor]:
    sink = ListTraceSink()
    proc = OutputProcessor("r", TOK, spec, stream, sink)
    # NOTE: the run acquires its stream buffer and trace handle itself; the model's here
    run = RequestRun("r", stream, sink, proc, prompt_tokens=2)
    for kind in MODEL_RESOURCES:
        run.acquire(kind, lambda: None)
    stream.start("m")
    for s in (State.QUEUED, State.PREFILLING, State.DECODING):
        run.lifecycle.transition(s)
    for i in script:
        assert proc.on_token(i, TokenInfo(i)) is None
    return run, proc


def test_l4_finish_returns_the_reason_it_ended_with() -> None:
    """L4: finish returns the terminal's reason: the loop's, or stop_sequence when the drain
    hits a stop, or transport_error when the drain overflows the stream's bound (P6)."""
    run, _ = _by_hand(RequestStream("r"), _spec(), [101])
    assert run.finish(FinishReason.MAX_OUTPUT_TOKENS) is FinishReason.MAX_OUTPUT_TOKENS
    bounded = RequestStream("r", BackpressureConfig(BackpressurePolicy.BUFFER, 2, 3))
    # NOTE: "A" and "BA" are sent (3 bytes, the bound); the held "B" overflows at the drain
    run, _ = _by_hand(bounded, _spec(stop_strings=("BCX",)), [101, 101])
    assert run.finish(FinishReason.EOS) is FinishReason.TRANSPORT_ERROR
    t = bounded.terminal
    assert t is not None and t.state is State.FAILED
    assert (t.finish_reason, t.error_code) == (FinishReason.TRANSPORT_ERROR,
                                               ErrorCode.BACKPRESSURE_OVERFLOW)


# ------------------------------------------------------------------------------ L7, P5

def test_l7_p5_a_failure_discards_held_output_and_closes_the_stop_buffer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """L7, P5: a model failure at decode 2 while "Bx" is held for "Bxy": the held bytes are
    never sent, the hold is counted up to the failure (two decode steps), and the timings
    stay those of the terminal afterwards."""
    clock = ManualClock(50.0)
    monkeypatch.setattr(time, "monotonic", clock)
    model = TickingModel([101, 107, 107], fail_at=2)
    model.clock = clock
    run = generate([1, 2], _spec(stop_strings=("Bxy",)), model, ScriptedChooser(), TOK)
    t = run.stream.terminal
    assert t is not None and t.state is State.FAILED and t.error_code is ErrorCode.MODEL_ERROR
    assert run.stream.text() == "A" and t.stop_buffer_s == 2.0
    clock.now += 10.0
    assert run.timings() == t.timings()


# ---------------------------------------------------------------------------------- L6
def test_l6_p5_a_live_run_without_model_work_counts_nothing() -> None:
    """L6, P5: read while live (before prefill), a run reports zero usage beyond its prompt,
    zero phase times and no cancel moments; so does the terminal of a run whose deadline
    passed before prefill."""
    seen: list[tuple[Usage, PhaseTimes, tuple[object, ...]]] = []

    def look(run: RequestRun) -> None:
        seen.append((run.usage(), run.timings(), (run.cancel_requested_at,
                     run.cancel_observed_at, run.cancel_effective_at, run.ended_at)))

    run = generate([1, 2], _spec(), ScriptedModel([101, EOS_ID]), ScriptedChooser(), TOK,
                   on_created=look, deadline=0.0, clock=lambda: 0.0)
    usage, tm, moments = seen[0]
    assert usage == Usage(prompt_tokens=2) and moments == (None, None, None, None)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.DEADLINE_EXCEEDED
    for timings in (tm, t.timings()):
        assert (timings["prefill_s"], timings["decode_s"], timings["stop_buffer_s"],
                timings["first_token_s"]) == (0.0, 0.0, 0.0, None)
    assert t.usage == Usage(prompt_tokens=2)


def test_l6_p5_a_run_without_a_processor_counts_only_its_prompt() -> None:
    """L6, P5: a run that never selects a token (no output processor: the lifecycle's own
    tests) reports zero selected and returned tokens and bytes and no stop-buffer time, live
    and in its terminal."""
    sink = ListTraceSink()
    stream = RequestStream("r")
    run = RequestRun("r", stream, sink, prompt_tokens=3)
    stream.start("m")
    assert run.usage() == Usage(prompt_tokens=3) and run.timings()["stop_buffer_s"] == 0.0
    run.lifecycle.transition(State.QUEUED)
    run.finish(FinishReason.EOS)
    t = stream.terminal
    assert t is not None and t.usage == Usage(prompt_tokens=3) and t.stop_buffer_s == 0.0
    assert (t.trailing_tokens, t.trailing_shown, t.prediction) == ((), 0, None)


def test_c1_a_cancel_observed_after_the_terminal_is_refused_and_records_nothing() -> None:
    """C1, L2: moment 2 after the request already ended (a lost race) returns False, marks no
    observed time and writes no row (not even one the sealed trace handle would drop)."""
    sink = ListTraceSink()
    stream = RequestStream("r")
    run = RequestRun("r", stream, sink, prompt_tokens=1)
    stream.start("m")
    run.lifecycle.transition(State.QUEUED)
    run.finish(FinishReason.EOS)
    n = len(sink.events)
    assert run.observe_cancel() is False
    assert run.cancel_observed_at is None and len(sink.events) == n
    assert run.trace.late_rows == 0


def test_l6_live_usage_is_usage_with_the_sent_pair() -> None:
    """L6 (a worker's billing report, coda.engine.process_engine): ``live_usage`` is
    ``usage()`` except that the returned bytes and tokens are the processor's one ``sent_mark``
    pair; without a processor both are 0."""
    stream = RequestStream("r")
    run, proc = _by_hand(stream, _spec(max_tokens=8, stop_strings=("Z",)), [101, 102])
    run.processed_output_tokens, run.cached_prompt_tokens = 2, 1
    assert run.live_usage() == run.usage() and run.usage().returned_bytes == 4
    proc.sent_mark = (3, 1)  # NOTE: a pair the counters moved past (read on another thread)
    live = run.live_usage()
    assert (live.returned_bytes, live.returned_tokens) == (3, 1)
    assert live == Usage(prompt_tokens=2, cached_prompt_tokens=1, selected_tokens=2,
                         processed_output_tokens=2, returned_tokens=1, returned_bytes=3)
    bare = RequestRun("b", RequestStream("b"), ListTraceSink(), prompt_tokens=3)
    assert bare.live_usage() == Usage(prompt_tokens=3)


# ---------------------------------------------------------------------------------- O1, L7
class _Watching(ListTraceSink):
    """Notes, with each row, whether the run's stream shows its end to readers yet."""

    def __init__(self, fail_on: str | None = None) -> None:
        super().__init__()
        self.stream: RequestStream | None = None
        self.seen: list[tuple[str, bool, int]] = []
        self.fail_on = fail_on

    def record(self, event: tr.TraceEvent) -> None:
        assert self.stream is not None
        self.seen.append((event.kind, self.stream.closed, self.stream.last_seq))
        if event.kind == self.fail_on:
            raise OSError("disk full")
        super().record(event)


@pytest.mark.parametrize("end", ["finish", "cancel", "fail"])
def test_o1_l7_l2_the_trace_is_sealed_before_the_terminal_is_published(end: str) -> None:
    """Every ending writes its terminal row (with the terminal event's seq) and its stream
    buffer's and trace handle's releases while readers still see no end; the event is
    published after the last row, so whoever sees the end finds the trace sealed (O1, L7).
    Its seq is fixed in the critical section (L2): the one after the last delta."""
    sink = _Watching()
    stream = RequestStream("w", model="m")
    sink.stream = stream
    run = RequestRun("w", stream, sink, prompt_tokens=1)
    run.lifecycle.transition(State.QUEUED)
    stream.delta(b"ab")
    if end == "finish":
        run.finish(FinishReason.EOS)
    elif end == "cancel":
        run.request_cancel()
        run.cancel()
    else:
        run.fail(RuntimeError("boom"))
    assert stream.closed and stream.terminal is not None
    terminal_seq = stream.last_seq
    assert terminal_seq == 2
    assert [(k, closed, last) for k, closed, last in sink.seen[-3:]] == [
        (tr.TERMINAL, False, 1), (tr.RESOURCE_RELEASED, False, 1),
        (tr.RESOURCE_RELEASED, False, 1)]
    assert next(e for e in sink.events if e.kind == tr.TERMINAL).data["seq"] == terminal_seq
    assert sink.events[-1].data["resource"] == "trace_handle"
    assert not any(closed for _, closed, _ in sink.seen)


def test_l2_l7_a_terminal_row_that_fails_to_write_still_publishes_the_end() -> None:
    """The sink raising on the terminal row (a full disk) propagates, but the terminal event
    fixed in the critical section is still published: no reader is left waiting."""
    sink = _Watching(fail_on=tr.TERMINAL)
    stream = RequestStream("f", model="m")
    sink.stream = stream
    run = RequestRun("f", stream, sink, prompt_tokens=1)
    run.lifecycle.transition(State.QUEUED)
    with pytest.raises(OSError):
        run.finish(FinishReason.EOS)
    assert stream.closed and stream.terminal is not None
    assert stream.terminal.finish_reason is FinishReason.EOS
