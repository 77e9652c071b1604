"""Every Responses ``function_call`` is answered (the API-gaps issue item 3; SPEC P1): an input
``function_call`` with no ``function_call_output`` of the same ``call_id`` after it — or a call
the continued response (``previous_response_id``) ended with that the new input leaves
unanswered — is a 400 in OpenAI's shape (``invalid_request_error``, param ``input``, "No tool
output found for function call X."), as OpenAI answers it, even when the input ends with the
call; answered in any order it passes. Through the official ``openai`` client over loopback,
and the check itself for all call sets (hypothesis).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.errors import InvalidRequestError
from coda.server.tool_results import check_responses_results
from tests.tools_support import RS_TOOLS, Wire, serve

MODEL = "tiny-chat"
USER: Any = {"role": "user", "content": "What time is it in UTC and CET?"}


def _call(cid: str) -> Any:
    return {"type": "function_call", "call_id": cid, "name": "get_time", "arguments": "{}"}


def _output(cid: str) -> Any:
    return {"type": "function_call_output", "call_id": cid, "output": "12:00"}


def _refused(exc: pytest.ExceptionInfo[openai.BadRequestError], cid: str) -> None:
    body: Any = exc.value.body
    assert exc.value.status_code == 400 and body["type"] == "invalid_request_error"
    assert body["param"] == "input"
    assert body["message"].startswith(f"No tool output found for function call {cid}.")


def test_p1_an_unanswered_function_call_is_a_400_naming_it(oa: openai.OpenAI) -> None:
    """P1: a call with no output after it is refused naming it (the first unanswered one),
    streamed or not, also when the input ends with the call; all answered (outputs in another
    order than the calls, a user turn after them) it is accepted."""
    both = [USER, _call("call_a"), _call("call_b"), _output("call_b"), _output("call_a")]
    assert oa.responses.create(model=MODEL, input=both, max_output_tokens=16).id
    assert oa.responses.create(model=MODEL, input=[*both, USER], max_output_tokens=16).id
    for items, missing in (([USER, _call("call_a")], "call_a"),
                           ([USER, _call("call_a"), _call("call_b"), _output("call_a")],
                            "call_b"),
                           ([USER, _call("call_a"), _call("call_b"), USER], "call_a"),
                           ([USER, _call("call_a"), _output("call_a"), _call("call_c"), USER],
                            "call_c")):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as exc:
                oa.responses.create(model=MODEL, input=items, max_output_tokens=16,
                                    stream=stream)
            _refused(exc, missing)


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    """The embedded default model: its context holds the tool prompt (tiny-chat's does not)."""
    yield from serve()


def test_p1_a_continued_response_s_calls_must_be_answered(wire: Wire) -> None:
    """P1: a stored response that ended with a function call is continued
    (``previous_response_id``) only by an input carrying that call's output: a text input, or
    a message without it, is a 400 naming the call; with it the continuation runs, and a
    later turn continuing *that* one (the call answered in its history) needs nothing more."""
    oa = wire.oa
    first = oa.responses.create(model=wire.model, input="time?", tools=RS_TOOLS, store=True,
                                tool_choice={"type": "function", "name": "get_time"},
                                parallel_tool_calls=False, max_output_tokens=60,
                                extra_body={"seed": 2})
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1, first.output
    cid = calls[0].call_id
    answerless: list[Any] = ["thanks", [USER]]
    for given_input in answerless:
        with pytest.raises(openai.BadRequestError) as exc:
            oa.responses.create(model=wire.model, input=given_input, previous_response_id=first.id,
                                tools=RS_TOOLS, max_output_tokens=16)
        _refused(exc, cid)
    second = oa.responses.create(model=wire.model, input=[_output(cid)], store=True,
                                 previous_response_id=first.id, tools=RS_TOOLS,
                                 tool_choice="none", max_output_tokens=16)
    assert second.status in ("completed", "incomplete")
    third = oa.responses.create(model=wire.model, input="thanks", previous_response_id=second.id,
                                tools=RS_TOOLS, tool_choice="none", max_output_tokens=16)
    assert third.status in ("completed", "incomplete")


# -- for all call sets (the check alone) -----------------------------------------------------
_IDS = st.lists(st.sampled_from([f"call_{c}" for c in "abcdef"]), min_size=1, max_size=4,
                unique=True)


@given(ids=_IDS, data=st.data())
def test_p1_every_call_answered_in_any_order_passes_one_missing_fails(
        ids: list[str], data: st.DataObject) -> None:
    """P1, for all call sets: outputs in any order after the calls pass; drop any one output
    and the input fails naming exactly that call."""
    outputs = data.draw(st.permutations(ids))
    check_responses_results([USER, *map(_call, ids), *map(_output, outputs)])
    dropped = data.draw(st.sampled_from(outputs))
    kept = [o for o in outputs if o != dropped]
    with pytest.raises(InvalidRequestError) as exc:
        check_responses_results([USER, *map(_call, ids), *map(_output, kept)])
    assert str(exc.value).startswith(f"No tool output found for function call {dropped}.")
    assert exc.value.field == "input"


@given(ids=_IDS, data=st.data())
def test_p1_a_previous_response_s_calls_answered_in_any_order_pass_one_missing_fails(
        ids: list[str], data: st.DataObject) -> None:
    """P1, for all call sets the continued response ended with (its history: one assistant
    message with the calls): outputs in any order pass; drop any one and it fails naming it;
    a call its history already answered needs no output."""
    history = [USER, {"role": "assistant", "content": "", "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
        for i in ids]}]
    outputs = data.draw(st.permutations(ids))
    check_responses_results([*map(_output, outputs)], history=history)
    dropped = data.draw(st.sampled_from(outputs))
    kept = [o for o in outputs if o != dropped]
    with pytest.raises(InvalidRequestError) as exc:
        check_responses_results([*map(_output, kept), USER], history=history)
    assert str(exc.value).startswith(f"No tool output found for function call {dropped}.")
    answered = [*history, {"role": "tool", "tool_call_id": dropped, "content": "12:00"}]
    check_responses_results([*map(_output, kept), USER], history=answered)


def test_p1_tools_and_tool_choice_are_echoed_as_sent_even_when_no_call_can_be_made(
        wire: Wire) -> None:
    """P1: ``tools`` and ``tool_choice`` come back as sent: with ``tool_choice: "none"`` (no
    call can be made) the object still lists the tools and says ``"none"`` (it said ``[]`` and
    ``"auto"``), on create, in the stream's first and last events and on retrieve; without
    tools: ``[]`` and ``"auto"``."""
    oa, names = wire.oa, [t["name"] for t in RS_TOOLS]
    none = oa.responses.create(model=wire.model, input="hi", max_output_tokens=16, store=True,
                               tools=RS_TOOLS, tool_choice="none")
    assert (none.tool_choice, [t.name for t in none.tools]) == ("none", names)  # type: ignore[union-attr]
    again = oa.responses.retrieve(none.id)
    assert (again.tool_choice, [t.name for t in again.tools]) == ("none", names)  # type: ignore[union-attr]
    events = list(oa.responses.create(model=wire.model, input="hi", max_output_tokens=16,
                                      tools=RS_TOOLS, tool_choice="none", stream=True))
    for ev in (events[0], events[-1]):
        assert (ev.response.tool_choice, len(ev.response.tools)) == (  # type: ignore[union-attr]
            "none", len(names))
    plain = oa.responses.create(model=wire.model, input="hi", max_output_tokens=16)
    assert (plain.tool_choice, plain.tools) == ("auto", [])
