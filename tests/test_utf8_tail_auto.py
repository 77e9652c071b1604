"""K3 for the budget: ``utf8_tail: auto``, the default (issue 20 deliverable 2; SPEC K2, K3,
G2, G3, L4, O1), on the reference loop with a scripted model.

A partial last character left by an end the model did not choose (max_tokens, the context
limit, the deadline) is text the budget did not finish: it is removed and recorded
(``dropped_tail``, a ``utf8_tail.dropped`` row) and the request keeps its own ending. An end
the model chose (EOS) with a partial character is the strict K3 rule: FAILED. ``fail`` and
``drop`` stay as explicit choices; cancel discards the tail (G2).
"""

from __future__ import annotations

import pytest

from coda import trace as tr
from coda.errors import ErrorCode
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.output import OutputSpec
from coda.request import RequestRun
from coda.trace import ListTraceSink, check_trace
from tests.reference_loop import generate
from tests.scripted import (
    EOS_ID,
    ManualClock,
    ScriptedChooser,
    ScriptedModel,
    TickingModel,
    scripted_tokenizer,
)
from tests.tokenizer_fixtures import sentencepiece_bpe

TABLE = {101: b"AB", 104: "é".encode()[:1], 105: "é".encode()[1:]}
TOK = scripted_tokenizer(TABLE)


def _go(script: list[int], **kw: object) -> tuple[RequestRun, ListTraceSink]:
    sink = ListTraceSink()
    run_kw = {k: kw.pop(k) for k in ("deadline", "clock", "on_created") if k in kw}
    model = kw.pop("model", None) or ScriptedModel(script)
    base: dict[str, object] = dict(max_tokens=50, eos_token_ids=frozenset({EOS_ID}))
    spec = OutputSpec(**{**base, **kw})  # type: ignore[arg-type]
    run = generate([1, 2], spec, model, ScriptedChooser(), TOK, trace=sink,  # type: ignore[arg-type]
                   **run_kw)  # type: ignore[arg-type]
    assert check_trace(sink.events) == []
    return run, sink


def _dropped_rows(sink: ListTraceSink) -> list[dict[str, object]]:
    return [dict(e.data) for e in sink.events if e.kind == tr.UTF8_TAIL_DROPPED]


@pytest.mark.parametrize("limits,reason", [
    ({"max_tokens": 2}, FinishReason.MAX_OUTPUT_TOKENS),
    ({"max_tokens": 2, "budget_end": FinishReason.CONTEXT_LIMIT}, FinishReason.CONTEXT_LIMIT),
])
def test_k3_auto_budget_end_inside_a_character_keeps_its_reason(
        limits: dict[str, object], reason: FinishReason) -> None:
    """K3 (issue 20 deliverable 2): ``AB`` + the lead byte of ``é``, then the budget ends the
    request: FINISHED with the budget's own reason, text ``AB``; the byte is removed and
    recorded in the terminal and the trace. ``fail`` asks for the strict rule: FAILED."""
    run, sink = _go([101, 104, 105, EOS_ID], **limits)
    t = run.stream.terminal
    assert t is not None and (t.state, t.finish_reason, t.error_code) == (
        State.FINISHED, reason, None)
    assert run.stream.text() == "AB" and t.dropped_tail == b"\xc3"
    assert _dropped_rows(sink) == [{"nbytes": 1, "hex": "c3"}]
    strict, _ = _go([101, 104, 105, EOS_ID], utf8_tail="fail", **limits)
    s = strict.stream.terminal
    assert s is not None and (s.state, s.finish_reason, s.error_code) == (
        State.FAILED, reason, ErrorCode.DECODING_ERROR)


def test_k3_auto_eos_inside_a_character_still_fails() -> None:
    """K3: the model ended (EOS) inside a character: bytes that can never form text, FAILED
    (decoding_error) under ``auto``; ``drop`` removes and records them instead."""
    run, sink = _go([101, 104, EOS_ID])
    t = run.stream.terminal
    assert t is not None and (t.state, t.finish_reason, t.error_code) == (
        State.FAILED, FinishReason.EOS, ErrorCode.DECODING_ERROR)
    assert run.stream.text() == "AB" and t.dropped_tail == b"" and _dropped_rows(sink) == []
    dropped, _ = _go([101, 104, EOS_ID], utf8_tail="drop")
    d = dropped.stream.terminal
    assert d is not None and (d.state, d.dropped_tail) == (State.FINISHED, b"\xc3")


def test_k3_g3_auto_deadline_drops_the_tail_and_cancel_discards_it() -> None:
    """K3, G3, G2: the deadline passes after ``AB`` + a lead byte: FINISHED
    ``deadline_exceeded``, text ``AB``, the byte removed and recorded (never FAILED); a cancel
    at the same point ends CANCELLED and the byte never reaches the stream."""
    clock = ManualClock(0.0)
    model = TickingModel([101, 104, 105, EOS_ID])
    model.clock = clock
    run, sink = _go([], model=model, deadline=1.5, clock=clock)
    t = run.stream.terminal
    assert t is not None and (t.state, t.finish_reason) == (
        State.FINISHED, FinishReason.DEADLINE_EXCEEDED)
    assert run.stream.text() == "AB" and t.dropped_tail == b"\xc3"
    assert _dropped_rows(sink) == [{"nbytes": 1, "hex": "c3"}]

    def cancel_at_2(r: RequestRun) -> None:
        model2.hooks[2] = r.request_cancel

    model2 = ScriptedModel([101, 104, 105, EOS_ID])
    run2, _ = _go([], model=model2, on_created=cancel_at_2)
    t2 = run2.stream.terminal
    assert t2 is not None and t2.state is State.CANCELLED and run2.stream.text() == "AB"


def test_k3_auto_byte_fallback_run_keeps_its_whole_characters() -> None:
    """K3, K4: on a byte-fallback tokenizer ``h`` and the first two bytes of ``€`` are one
    pending run when max_tokens ends it: ``auto`` returns ``h`` and removes only the partial
    ``€`` (so does ``drop``); ``fail`` ends FAILED."""
    tok = sentencepiece_bpe()
    v = tok.get_vocab()
    word = "▁st"  # NOTE: a plain word piece of the trained vocabulary
    script = [v[word], v["<0x68>"], v["<0xE2>"], v["<0x82>"]]
    for policy in ("auto", "drop"):
        spec = OutputSpec(max_tokens=4, utf8_tail=policy)
        run = generate([v[word]], spec, ScriptedModel(script), ScriptedChooser(), tok)
        t = run.stream.terminal
        assert t is not None and (t.state, t.finish_reason) == (
            State.FINISHED, FinishReason.MAX_OUTPUT_TOKENS)
        assert run.stream.text() == " sth" and t.dropped_tail == b"\xe2\x82"
    spec = OutputSpec(max_tokens=4, utf8_tail="fail")
    run = generate([v[word]], spec, ScriptedModel(script), ScriptedChooser(), tok)
    assert run.stream.terminal is not None and run.stream.terminal.state is State.FAILED
