"""The reference loop's own steps, seen from outside (issue 8, mutation survivors of
tests/reference_loop.py): the stream's start event (E1), the prefill rows and lifecycle (O1, L1), the
deadline reached exactly (G3), and failures in prefill, choose and the per-token step, each
ending FAILED with every resource released once (L4, L7).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from coda import trace as tr
from coda.errors import ErrorCode
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.output import EarlyStopVerdict, OutputSpec
from coda.request import RequestRun
from coda.stream import EventType
from coda.trace import ListTraceSink, check_trace
from tests.reference_loop import Choice, generate
from tests.scripted import EOS_ID, ScriptedChooser, ScriptedModel, scripted_tokenizer

TABLE = {101: b"AB", 102: b"CD", 103: b"EF"}
TOK = scripted_tokenizer(TABLE)
SPEC = OutputSpec(max_tokens=50, eos_token_ids=frozenset({EOS_ID}))


def test_e1_o1_l1_start_event_prefill_rows_and_lifecycle() -> None:
    """E1: the stream opens with a start event naming the model. O1: prefill.started carries
    the prompt length and prefill.completed the cache length. L1: QUEUED → PREFILLING →
    DECODING → DRAINING → FINISHED. L6: the whole prompt was processed."""
    sink = ListTraceSink()
    run = generate([1, 2, 3], SPEC, ScriptedModel([101, EOS_ID]), ScriptedChooser(), TOK,
                   trace=sink, model_name="tiny")
    assert check_trace(sink.events) == []
    first = run.stream.events_after(-1)[0]
    assert first.type is EventType.START and first.model == "tiny" and first.seq == 0
    rows = {e.kind: e.data for e in sink.events
            if e.kind in (tr.PREFILL_STARTED, tr.PREFILL_COMPLETED)}
    assert rows == {tr.PREFILL_STARTED: {"tokens": 3}, tr.PREFILL_COMPLETED: {"cache_len": 3}}
    assert sink.kinds().index(tr.PREFILL_STARTED) < sink.kinds().index(tr.PREFILL_COMPLETED)
    path = [e.data["to"] for e in sink.events if e.kind == tr.LIFECYCLE]
    assert path == ["QUEUED", "PREFILLING", "DECODING", "DRAINING", "FINISHED"]
    t = run.stream.terminal
    assert t is not None and t.usage.processed_prompt_tokens == 3


@pytest.mark.parametrize(("at_call", "selected"), [(1, 0), (3, 1)])
def test_g3_a_deadline_reached_exactly_ends_the_request(at_call: int, selected: int) -> None:
    """G3: the deadline is checked as "now >= deadline": a clock that reads exactly the
    deadline ends the request, before prefill (call 1) or at the second step's safe point."""
    calls = [0]

    def clock() -> float:
        calls[0] += 1
        return 10.0 if calls[0] >= at_call else 0.0

    model = ScriptedModel([101, 102, EOS_ID])
    run = generate([1, 2, 3], SPEC, model, ScriptedChooser(), TOK, deadline=10.0, clock=clock)
    t = run.stream.terminal
    assert t is not None and t.finish_reason is FinishReason.DEADLINE_EXCEEDED
    assert t.usage.selected_tokens == selected
    assert (("prefill", 3) in model.calls) is (at_call > 1)  # NOTE: before prefill: no model work


class _FailingPrefill(ScriptedModel):
    def prefill(self, token_ids: Sequence[int]) -> int:
        raise RuntimeError("no memory")


class _FailingChooser(ScriptedChooser):
    def choose(self, logits: int, step: int, output_ids: Sequence[int]) -> Choice:
        if step == 1:
            raise RuntimeError("bad logits")
        return super().choose(logits, step, output_ids)


def _boom(n: int, conf: float) -> EarlyStopVerdict:
    raise RuntimeError("policy crashed")


@pytest.mark.parametrize(("where", "text", "selected"), [
    ("prefill", "", 0), ("choose", "AB", 1), ("step", "AB", 1)])
def test_l4_l7_failures_in_prefill_choose_and_step_end_failed_and_release_all(
        where: str, text: str, selected: int) -> None:
    """L4, L7: an exception in prefill, in choose or inside the per-token step ends the
    request FAILED with model_error, one terminal, no further model call, and every resource
    released once."""
    sink = ListTraceSink()
    model = (_FailingPrefill if where == "prefill" else ScriptedModel)([101, 102, EOS_ID])
    chooser = _FailingChooser() if where == "choose" else ScriptedChooser()
    box: list[RequestRun] = []
    run = generate([1, 2, 3], SPEC, model, chooser, TOK, trace=sink, on_created=box.append,
                   early_stop=_boom if where == "step" else None)
    assert check_trace(sink.events) == []
    t = run.stream.terminal
    assert t is not None and t.state is State.FAILED and run is box[0]
    assert (t.finish_reason, t.error_code) == (FinishReason.MODEL_ERROR, ErrorCode.MODEL_ERROR)
    assert run.stream.text() == text and t.usage.selected_tokens == selected
    assert sink.kinds().count(tr.TERMINAL) == 1 and sink.kinds()[-1] != tr.DECODE_STARTED
    assert run.lifecycle.held == frozenset() and len(run.lifecycle.released) == 5
    assert model.released == 1
    assert [c for c in model.calls if c[0] == "decode"] == ([("decode", 3)] if where == "choose"
                                                            else [])
