"""How a run ends, through the reference loop on a scripted model: resources and the terminal
on overflow (L7, P6), the order of checks between competing endings (G1), usage with stops
(L6), timings (P5), the drained tail (G2) and the §4.12 failure rows as checker regressions
(O2). Issue 8, "tests that can fail"."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from coda import trace as tr
from coda.errors import ErrorCode
from coda.finish import CancelCause, FinishReason
from coda.lifecycle import State
from coda.output import OutputSpec
from coda.request import RequestRun
from coda.stream import RequestStream
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy
from coda.trace import ListTraceSink, TraceEvent, check_trace
from tests.dedupe import Deduper
from tests.reference_loop import generate
from tests.scripted import EOS_ID, ScriptedChooser, ScriptedModel, output_spec, scripted_tokenizer
from tests.tokenizer_fixtures import sentencepiece_bpe
from tests.wakeup_support import PostLog

TABLE = {101: b"AB", 102: b"CD", 103: b"EF", 104: "é".encode()[:1], 105: "é".encode()[1:],
         107: b"x"}
TOK = scripted_tokenizer(TABLE)


_spec = output_spec


def _go(script: list[int], *, stream: RequestStream | None = None,
        on_created: Callable[[RequestRun], None] | None = None,
        hooks: dict[int, Callable[[], None]] | None = None,
        deadline: float | None = None, clock: Callable[[], float] | None = None,
        **kw: object) -> tuple[RequestRun, ListTraceSink, ScriptedModel]:
    sink = ListTraceSink()
    model = ScriptedModel(script, hooks=hooks or {})
    extra = {"clock": clock} if clock is not None else {}
    run = generate([1, 2], _spec(**kw), model, ScriptedChooser(), TOK, trace=sink,
                   stream=stream, on_created=on_created, deadline=deadline, **extra)
    assert check_trace(sink.events) == []
    return run, sink, model


# ---------------------------------------------------------------------------- L7, P6 (defect 5)
def test_l7_p6_reference_loop_overflow_fails_with_its_own_error_and_releases_all() -> None:
    """L7, P6 (defect 5): a bounded buffer that overflows mid-decode ends the run FAILED with
    backpressure_overflow / transport_error, one terminal, every resource released once, the
    text sent so far intact and nothing claimed complete."""
    stream = RequestStream("req-0", BackpressureConfig(BackpressurePolicy.BUFFER, 2, 4))
    run, sink, model = _go([101, 101, 101, 101, EOS_ID], stream=stream)
    t = stream.terminal
    assert t is not None and t.state is State.FAILED
    assert (t.finish_reason, t.error_code) == (FinishReason.TRANSPORT_ERROR,
                                               ErrorCode.BACKPRESSURE_OVERFLOW)
    assert run.lifecycle.state is State.FAILED and run.lifecycle.held == frozenset()
    assert len(run.lifecycle.released) == 5 and model.released == 1
    assert stream.text() == "ABAB" and t.usage.returned_bytes == 4
    assert sink.kinds().count(tr.TERMINAL) == 1


# ---------------------------------------------------------------------------------- G1 orders
def test_g1_cancel_before_deadline_at_the_same_safe_point() -> None:
    """G1: cancel is checked before the deadline: both due at one safe point -> CANCELLED
    (before prefill and during decoding), never deadline_exceeded."""
    run, _, model = _go([107] * 5, on_created=lambda r: r.request_cancel(), deadline=0.0,
                        clock=lambda: 1.0)
    assert run.stream.terminal is not None
    assert run.stream.terminal.finish_reason is FinishReason.CANCELLED and model.calls == []
    now = [0.0]
    holder: list[RequestRun] = []

    def both_at_step_2() -> None:
        holder[0].request_cancel()
        now[0] = 10.0  # NOTE: the deadline passes in the same decode step

    run, _, _ = _go([107] * 5, on_created=holder.append, hooks={2: both_at_step_2},
                    deadline=5.0, clock=lambda: now[0])
    t = run.stream.terminal
    assert t is not None and (t.state, t.finish_reason) == (State.CANCELLED,
                                                            FinishReason.CANCELLED)
    assert t.usage.selected_tokens == 2


def test_g1_stop_hit_before_max_tokens_and_the_budget_ends_with_the_plans_reason() -> None:
    """G1: on one token, a stop hit wins over max tokens (text cut, reason stop_sequence); the
    budget ends the output at exactly ``max_tokens`` tokens with the reason the plan fixed
    (L4: ``context_limit`` for a context-bound plan, whose budget is the room the context
    leaves; which of the two applies is decided once, by coda.engine.plan)."""
    run, _, _ = _go([101, 102, 103], stop_strings=("CD",), max_tokens=2)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.STOP_SEQUENCE
    assert run.stream.text() == "AB" and t.stop is not None and t.stop.stop == "CD"
    run, _, _ = _go([107] * 5, max_tokens=3)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert t.usage.selected_tokens == 3
    run, _, _ = _go([107] * 5, max_tokens=3, budget_end=FinishReason.CONTEXT_LIMIT)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.CONTEXT_LIMIT
    assert t.usage.selected_tokens == 3


# ----------------------------------------------------------------------------- L6 with stops
def test_l6_usage_differs_as_stated_on_stop_strings_and_stop_id_sequences() -> None:
    """L6: a stop string: selected 2, processed 1 (the hitting token is never decoded),
    returned 1 ("AB" reached the stream as "A"), 1 byte. A stop id sequence: its ids are
    selected but never returned; processed = selected - 1."""
    run, _, _ = _go([101, 102, 103], stop_strings=("BCD",))
    u = run.stream.terminal.usage if run.stream.terminal else None
    assert u is not None and run.stream.text() == "A"
    assert (u.selected_tokens, u.processed_output_tokens, u.returned_tokens,
            u.returned_bytes) == (2, 1, 1, 1)
    run, _, _ = _go([107, 101, 102, 103], stop_token_ids=((101, 102),))
    u = run.stream.terminal.usage if run.stream.terminal else None
    assert u is not None and run.stream.text() == "x"
    assert (u.selected_tokens, u.processed_output_tokens, u.returned_tokens,
            u.returned_bytes) == (3, 2, 1, 1)
    run, _, _ = _go([101, 102, 103], stop_strings=("BCD",), include_stop_str_in_output=True)
    u = run.stream.terminal.usage if run.stream.terminal else None
    assert u is not None and run.stream.text() == "ABCD"
    assert (u.selected_tokens, u.returned_tokens, u.returned_bytes) == (2, 2, 4)


# ------------------------------------------------------------------------------------ P5
def _slow_model(script: list[int], prefill_s: float, step_s: float) -> ScriptedModel:
    class Slow(ScriptedModel):
        def prefill(self, token_ids: list[int]) -> int:  # type: ignore[override]
            time.sleep(prefill_s)
            return super().prefill(token_ids)

        def decode_one(self, token_id: int, position: int) -> int:
            time.sleep(step_s)
            return super().decode_one(token_id, position)

    return Slow(script)


def test_p5_timings_measure_each_phase_and_the_stop_buffer() -> None:
    """P5: queue, prefill, decode and stop-buffer times are measured, not zero: lower bounds
    from the model's own sleeps, and the phases add up to the total."""
    sink = ListTraceSink()
    # NOTE: "B" of "AB" is held as a prefix of "BCX" across the decode of 101 (one step_s)
    spec = _spec(stop_strings=("BCX",))
    run = generate([1, 2], spec, _slow_model([101, 102, 103, EOS_ID], 0.05, 0.02),
                   ScriptedChooser(), TOK, trace=sink)
    t = run.stream.terminal
    assert t is not None and run.stream.text() == "ABCDEF"
    assert t.prefill_s >= 0.05 and t.decode_s >= 3 * 0.02 and t.queue_s >= 0.0
    assert t.stop_buffer_s >= 0.02 and t.stop_buffer_s <= t.decode_s
    assert t.first_token_s is not None and t.prefill_s <= t.first_token_s <= t.total_s
    assert abs(t.queue_s + t.prefill_s + t.decode_s - t.total_s) < 1e-6
    plain = generate([1, 2], _spec(), _slow_model([107, EOS_ID], 0.0, 0.0), ScriptedChooser(),
                     TOK).stream.terminal
    assert plain is not None and plain.stop_buffer_s == 0.0


# ---------------------------------------------------------------------------------- G2
def test_g2_tail_drained_at_finish_passes_the_stop_matcher() -> None:
    """G2: a byte-fallback run is held until finish() (a text token never closed it); the
    drained tail still meets the stop matcher: "中" is a stop -> stop_sequence and it is not
    shown; without that stop the drained "中" is the last delta."""
    tok = sentencepiece_bpe()
    vocab = tok.get_vocab()
    run_ids = [vocab[f"<0x{b:02X}>"] for b in "中".encode()]
    head = [vocab["▁the"]] if "▁the" in vocab else tok.encode("the").ids
    script = head + run_ids
    spec = OutputSpec(max_tokens=len(script), stop_strings=("中",))
    sink = ListTraceSink()
    run = generate(tok.encode("Hi").ids, spec, ScriptedModel(script), ScriptedChooser(), tok,
                   trace=sink)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.STOP_SEQUENCE
    assert "中" not in run.stream.text() and t.stop is not None and t.stop.stop == "中"
    kinds = sink.kinds()
    # NOTE: the hit happens in DRAINING, i.e. on the tail that finish() drained
    draining = next(i for i, e in enumerate(sink.events)
                    if e.kind == tr.LIFECYCLE and e.data["to"] == "DRAINING")
    assert kinds.index(tr.STOP_HIT) > draining
    spec = OutputSpec(max_tokens=len(script))
    run = generate(tok.encode("Hi").ids, spec, ScriptedModel(script), ScriptedChooser(), tok)
    last = run.stream.events_after(-1)[-2]
    assert run.stream.text().endswith("中") and last.data == "中".encode()
    assert check_trace(sink.events) == []


# ------------------------------------------------------------------------ O2: §4.12 rows
def _doctor(events: list[TraceEvent], kind: str, **changes: object) -> list[TraceEvent]:
    """The trace with the last ``kind`` row's data changed: the symptom, injected."""
    i = max(k for k, e in enumerate(events) if e.kind == kind)
    ev = events[i]
    return [*events[:i], TraceEvent(ev.request_id, kind, {**ev.data, **changes}),
            *events[i + 1:]]


def test_o2_row1_eos_is_never_shown_and_the_checker_flags_it() -> None:
    """O2 row 1 (EOS handed to the detokenizer and shown): even with skip_special_tokens off,
    EOS never reaches the text; a trace where it did is flagged."""
    run, sink, _ = _go([101, EOS_ID], skip_special_tokens=False)
    assert run.stream.text() == "AB"
    t = run.stream.terminal
    assert t is not None and t.usage.returned_tokens == 1 < t.usage.selected_tokens == 2
    shown = _doctor(sink.events, tr.TERMINAL, usage={**t.usage.to_dict(), "returned_tokens": 2})
    assert any("EOS shown" in p for p in check_trace(shown))


def test_o2_row2_cross_token_stop_never_leaks_and_the_checker_flags_a_leak() -> None:
    """O2 row 2 (a matcher that sees one token at a time): "BCD" spans tokens and is caught
    with nothing of it sent; a trace where it reached the stream before the hit is flagged."""
    run, sink, _ = _go([101, 102, 103], stop_strings=("BCD",))
    assert run.stream.text() == "A"
    leaked = _doctor(sink.events, tr.STREAM_DELTA, text="ABCDEF", nbytes=6)
    assert any("before its hit" in p for p in check_trace(leaked))


def test_o2_row5_the_buffer_is_bounded_for_a_reader_that_never_reads() -> None:
    """O2 row 5 (unbounded backpressure buffer): unacknowledged bytes never pass max_bytes; past
    it the run fails with its own error instead of growing (see the L7/P6 test above)."""
    posts = PostLog(probe=lambda: stream.unacked_bytes)
    stream = RequestStream("req-0", BackpressureConfig(BackpressurePolicy.BUFFER, 4, 6),
                           channel=posts)
    run, _, _ = _go([107] * 20, stream=stream)
    seen = posts.probed
    t = run.stream.terminal
    assert t is not None and t.error_code is ErrorCode.BACKPRESSURE_OVERFLOW
    assert max(seen) <= 6 and run.stream.text() == "xxxxxx"


def test_o2_row6_disconnect_is_transport_error_never_eos_and_the_checker_flags_it() -> None:
    """O2 row 6, L5, P4 (a disconnect recorded as EOS): it ends CANCELLED transport_error; a
    trace reporting it as eos is flagged."""
    holder: list[RequestRun] = []
    run, sink, _ = _go([107] * 5, on_created=holder.append,
                       hooks={2: lambda: holder[0].request_cancel(CancelCause.DISCONNECT)})
    t = run.stream.terminal
    assert t is not None and (t.state, t.finish_reason) == (State.CANCELLED,
                                                            FinishReason.TRANSPORT_ERROR)
    as_eos = _doctor(sink.events, tr.TERMINAL, reason="eos")
    assert any("reported as eos" in p for p in check_trace(as_eos))


def test_o2_row7_replays_are_deduped_by_sequence_number() -> None:
    """O2 row 7, P3 (a reconnect not deduped): overlapping replays merge to the original text
    exactly once; a trace repeating a delta's sequence number is flagged."""
    run, sink, _ = _go([101, 102, 103, EOS_ID])
    events = run.stream.events_after(-1)
    dedupe = Deduper()
    merged = [ev for chunk in (events[:3], events[1:], events[2:4], events)
              for ev in chunk for ev in dedupe.push(ev)]
    assert [e.seq for e in merged] == [e.seq for e in events]
    assert b"".join(e.data for e in merged).decode() == "ABCDEF"
    i = max(k for k, e in enumerate(sink.events) if e.kind == tr.STREAM_DELTA)
    repeated = [*sink.events[: i + 1], sink.events[i], *sink.events[i + 1:]]
    assert any("not greater" in p for p in check_trace(repeated))


def test_l2_one_constructor_refuses_a_processor_beside_output_or_no_tokenizer() -> None:
    """L2 (issue 22's one constructor): ``output=`` builds the processor from ``tokenizer=``;
    a processor given beside it, or no tokenizer, is a TypeError before anything is held."""
    done = RequestRun("ok", None, ListTraceSink(), prompt_tokens=1, output=output_spec(),
                      tokenizer=TOK)
    assert done.processor is not None
    with pytest.raises(TypeError, match="tokenizer"):
        RequestRun("a", None, ListTraceSink(), prompt_tokens=1, output=output_spec())
    with pytest.raises(TypeError, match="processor"):
        RequestRun("b", None, ListTraceSink(), done.processor, prompt_tokens=1,
                   output=output_spec(), tokenizer=TOK)
