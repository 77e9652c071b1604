"""The reference loop on a scripted model: exact event orders (E1, C3), check order (G1–G3),
step state (T1–T3), cancellation (C1–C3), trace (O1) and every finish reason (L4, L5)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from coda import trace as tr
from coda.finish import CancelCause, FinishReason
from coda.lifecycle import ResourceKind, State
from coda.output import OutputSpec
from coda.request import RequestRun
from coda.stream import EventType
from coda.trace import ListTraceSink, check_trace
from tests.reference_loop import generate
from tests.scripted import EOS_ID, ScriptedChooser, ScriptedModel, scripted_tokenizer

TABLE = {101: b"AB", 102: b"CD", 103: b"EF", 104: "é".encode()[:1], 105: "é".encode()[1:],
         106: b"\xff", 107: b"x"}
TOK = scripted_tokenizer(TABLE)


def spec(**kw: object) -> OutputSpec:
    base: dict[str, object] = dict(max_tokens=50, eos_token_ids=frozenset({EOS_ID}))
    base.update(kw)
    return OutputSpec(**base)  # type: ignore[arg-type]


def run_script(script: list[int], *, hooks: dict[int, Callable[[], None]] | None = None,
               on_created: Callable[[RequestRun], None] | None = None,
               fail_at: int | None = None, **kw: object) -> tuple[RequestRun, ListTraceSink,
                                                                  ScriptedModel]:
    sink = ListTraceSink()
    model = ScriptedModel(script, hooks=hooks or {}, fail_at=fail_at)
    deadline = kw.pop("deadline", None)
    clock = kw.pop("clock", None)
    extra = {"clock": clock} if clock is not None else {}
    run = generate([1, 2], spec(**kw), model, ScriptedChooser(), TOK, trace=sink,
                   on_created=on_created, deadline=deadline, **extra)  # type: ignore[arg-type]
    assert check_trace(sink.events) == []
    return run, sink, model


def visible(sink: ListTraceSink) -> list[str]:
    """The E1 view of a trace: selections, deltas, decodes, stop hits, terminal."""
    out: list[str] = []
    for e in sink.events:
        if e.kind == tr.TOKEN_SELECTED:
            out.append(f"selected({e.data['token_id']})")
        elif e.kind == tr.STREAM_DELTA:
            out.append(f"delta({e.data['text']!r})")
        elif e.kind == tr.DECODE_COMPLETED:
            out.append(f"decode({e.data['t']})")
        elif e.kind == tr.STOP_HIT:
            out.append(f"stop_hit({e.data['stop']!r})")
        elif e.kind == tr.TERMINAL:
            out.append(f"completed({e.data['reason']})")
    return out


def test_e1_s2_cross_token_stop_exact_event_order() -> None:
    """Experiment A: 101->"AB", 102->"CD", stop "BCD"; only "A" is returned (E1, S2, S3, G2)."""
    run, sink, model = run_script([101, 102, 103, 103], stop_strings=("BCD",))
    assert visible(sink) == ["selected(101)", "delta('A')", "decode(1)", "selected(102)",
                             "stop_hit('BCD')", "completed(stop_sequence)"]
    assert run.stream.text() == "A"
    assert run.stream.terminal is not None
    assert run.stream.terminal.finish_reason is FinishReason.STOP_SEQUENCE
    assert run.stream.terminal.stop is not None and run.stream.terminal.stop.stop == "BCD"
    # T2: no logits after the terminating token: one decode only
    assert [c for c in model.calls if c[0] == "decode"] == [("decode", 2)]


def test_c2_c3_c4_cancel_during_decode_step_3() -> None:
    """Experiment B: cancel injected after decode.started(3), before decode.completed(3)
    (C1–C3). The in-flight step finishes and its result is discarded (C2); the already-sent
    prefix stands, with no rollback event — cancel cannot undo what was sent (C4)."""
    holder: dict[str, RequestRun] = {}
    run, sink, model = run_script(
        [107, 107, 107, 107, 107, 107],
        hooks={3: lambda: holder["run"].request_cancel(CancelCause.CLIENT)},
        on_created=lambda r: holder.__setitem__("run", r))
    kinds = sink.kinds()
    assert run.lifecycle.state is State.CANCELLED
    selected = [e.data["t"] for e in sink.events if e.kind == tr.TOKEN_SELECTED]
    assert selected == [1, 2, 3]  # no token.selected(step=4)
    i_started = next(i for i, e in enumerate(sink.events)
                     if e.kind == tr.DECODE_STARTED and e.data["t"] == 3)
    after = kinds[i_started:]
    assert after.index(tr.CANCEL_REQUESTED) < after.index(tr.DECODE_COMPLETED) \
        < after.index(tr.CANCEL_OBSERVED) < after.index(tr.CANCEL_EFFECTIVE) < after.index(tr.TERMINAL)
    evs = run.stream.events_after(-1)
    assert evs[-1].type is EventType.TERMINAL and all(e.type is not EventType.DELTA
                                                     for e in evs[evs.index(evs[-1]):])
    assert run.stream.text() == "xxx"  # already-sent prefix unchanged, no rollback event
    assert model.released == 1
    released = [e.data["resource"] for e in sink.events if e.kind == tr.RESOURCE_RELEASED]
    assert sorted(released) == sorted(k.value for k in ResourceKind)  # each exactly once
    assert run.stream.terminal is not None
    assert run.stream.terminal.finish_reason is FinishReason.CANCELLED
    assert run.cancel_requested_at and run.cancel_observed_at and run.cancel_effective_at


def test_g1_order_of_checks_eos_before_detokenize_and_not_shown() -> None:
    """EOS ends at once and is never detokenized or displayed (S1, O2 row 1)."""
    run, sink, _ = run_script([101, EOS_ID, 102])
    assert run.stream.text() == "AB"
    assert run.stream.terminal is not None
    assert run.stream.terminal.finish_reason is FinishReason.EOS
    assert "<eos>" not in run.stream.text()
    u = run.stream.terminal.usage
    assert (u.selected_tokens, u.returned_tokens, u.processed_output_tokens) == (2, 1, 1)  # L6


def test_l4_max_output_tokens_and_context_limit() -> None:
    run, _, _ = run_script([107] * 10, max_tokens=3)
    assert run.stream.terminal and run.stream.terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert run.stream.text() == "xxx"
    # NOTE: a context-bound plan (prompt 2, context 5): its budget is the room, 3 tokens
    run, _, _ = run_script([107] * 10, max_tokens=3, budget_end=FinishReason.CONTEXT_LIMIT)
    assert run.stream.terminal and run.stream.terminal.finish_reason is FinishReason.CONTEXT_LIMIT
    assert run.stream.text() == "xxx"


def test_g3_deadline_is_its_own_reason_not_cancelled() -> None:
    ticks = iter([0.0, 0.0, 0.0, 5.0, 5.0, 5.0])
    run, _, _ = run_script([107] * 10, deadline=1.0, clock=lambda: next(ticks, 9.0))
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.DEADLINE_EXCEEDED
    assert t.state is State.FINISHED and run.stream.text() == "xx"


def test_g3_deadline_before_prefill_ends_without_model_work() -> None:
    run, _, model = run_script([107], deadline=1.0, clock=lambda: 2.0)
    assert run.stream.terminal and run.stream.terminal.finish_reason is FinishReason.DEADLINE_EXCEEDED
    assert model.calls == []


def test_c1_cancel_while_queued_never_runs_the_model() -> None:
    run, sink, model = run_script([107], on_created=lambda r: r.request_cancel())
    assert run.lifecycle.state is State.CANCELLED and model.calls == []
    assert tr.TOKEN_SELECTED not in sink.kinds()


def test_k3_g2_partial_utf8_tail_fails_on_finish_but_not_after_stop() -> None:
    # "é" split over two tokens: nothing is emitted until complete (K3)
    run, sink, _ = run_script([104, 105, EOS_ID])
    assert run.stream.text() == "é"
    # a dangling first byte at a normal end -> decoding error -> FAILED, prefix stands (K3)
    run, _, _ = run_script([107, 104, EOS_ID])
    t = run.stream.terminal
    assert t is not None and t.state is State.FAILED and t.error_code is not None
    assert t.error_code.value == "decoding_error" and run.stream.text() == "x"
    assert t.finish_reason is FinishReason.EOS  # why the loop stopped; the drain then failed
    # a dangling byte still pending when a stop hits is discarded without finish() (G2):
    # stop token ids end the request while the detokenizer holds the first byte of "é"
    run, _, _ = run_script([107, 104, 101, 102], stop_token_ids=((101, 102),))
    t = run.stream.terminal
    assert t is not None and t.state is State.FINISHED
    assert t.finish_reason is FinishReason.STOP_SEQUENCE and run.stream.text() == "x"


def test_s2_k3_stop_completed_by_a_characters_last_byte() -> None:
    """S2, K3: "éx" spans a character split over two tokens and a third token: it hits while
    decoding. (G2's drained-tail case is test_request_run.py's G2 test.)"""
    run, _, _ = run_script([107, 104, 105, 107, EOS_ID], stop_strings=("éx",))
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.STOP_SEQUENCE
    assert run.stream.text() == "x"


def test_l4_model_error_ends_failed_and_releases_once() -> None:
    run, sink, model = run_script([107] * 5, fail_at=2)
    t = run.stream.terminal
    assert t is not None and t.state is State.FAILED and t.finish_reason is FinishReason.MODEL_ERROR
    assert model.released == 1 and run.stream.text() == "xx"


def test_s1_stop_token_id_sequence_never_leaks_its_text() -> None:
    run, _, _ = run_script([107, 101, 102, 103], stop_token_ids=((101, 102),))
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.STOP_SEQUENCE
    assert run.stream.text() == "x"
    # a partial id match that breaks releases the held text
    run, _, _ = run_script([101, 103, EOS_ID], stop_token_ids=((101, 102),))
    assert run.stream.text() == "ABEF"


def test_t1_selected_minus_decoded_is_zero_or_one_everywhere() -> None:
    _, sink, _ = run_script([101, 103, 107, 107, EOS_ID])
    sel = dec = 0
    for e in sink.events:
        sel += e.kind == tr.TOKEN_SELECTED
        dec += e.kind == tr.DECODE_COMPLETED
        assert sel - dec in (0, 1)
    assert (sel, dec) == (5, 4)


def test_o1_trace_records_every_required_fact(tmp_path: pytest.TempPathFactory) -> None:
    _, sink, _ = run_script([101, 102, 103, EOS_ID], stop_strings=("CDX",))
    kinds = set(sink.kinds())
    for k in (tr.LIFECYCLE, tr.TOKEN_SELECTED, tr.DECODE_COMPLETED, tr.STOP_STATE,
              tr.STREAM_DELTA, tr.RESOURCE_RELEASED, tr.TERMINAL):
        assert k in kinds
    dec = [e for e in sink.events if e.kind == tr.DECODE_COMPLETED]
    assert [e.data["cache_len"] for e in dec] == [3, 4, 5]


def test_o2_checker_catches_each_failure_row() -> None:
    """§4.12 rows as checker regressions: two terminals, delta after terminal, off-by-one
    cache, double release (O2, L2, L3, T1, L7)."""
    _, sink, _ = run_script([101, EOS_ID])
    good = list(sink.events)
    term = next(e for e in good if e.kind == tr.TERMINAL)
    assert any("more than one terminal" in p for p in check_trace(good + [term]))
    late = tr.TraceEvent("req-0", tr.STREAM_DELTA, {"seq": 99, "nbytes": 1, "text": "z"})
    assert any("after the terminal" in p for p in check_trace(good + [late]))
    extra_dec = tr.TraceEvent("req-0", tr.DECODE_COMPLETED, {"t": 9, "cache_len": 9})
    i = next(i for i, e in enumerate(good) if e.kind == tr.DECODE_COMPLETED)
    assert any("exceeds selected" in p for p in check_trace(good[:i] + [extra_dec] + good[i:]))
    rel = next(e for e in good if e.kind == tr.RESOURCE_RELEASED)
    assert any("released 2x" in p for p in check_trace(good + [rel]))
