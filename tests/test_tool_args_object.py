"""A call's `arguments` are always a JSON object, whatever the tool's schema leaves open
(docs/api.md "Tool calling"; SPEC S1: the grammar alone shapes a call).

A schema without `type` (`{}`, OpenAI's "no parameters"; `{"properties": ...}`) allowed any
JSON value, so a forced call could come back with an array as its `arguments` (or, for a
string, as text): such a schema is now taken as an object's, and one that cannot describe an
object (`anyOf` of an integer and a string) is a 400 naming the tool.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.tools_support import ASK, Wire, serve


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    yield from serve()


@pytest.mark.parametrize("params", [{}, {"properties": {"a": {"type": "integer"}}}])
def test_s1_untyped_schema_calls_have_object_arguments(wire: Wire,
                                                       params: dict[str, Any]) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for seed in range(6):
        r = wire.oa.chat.completions.create(model=wire.model, messages=ASK, tools=tools,
                                            tool_choice="required", max_tokens=60,
                                            temperature=1.0, seed=seed,
                                            parallel_tool_calls=False)
        for call in r.choices[0].message.tool_calls or []:
            assert isinstance(json.loads(call.function.arguments), dict), call


def test_s1_schema_that_is_no_object_is_400_naming_the_tool(wire: Wire) -> None:
    tools: Any = [{"type": "function", "function": {
        "name": "f", "parameters": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}]
    with pytest.raises(openai.BadRequestError) as e:
        wire.oa.chat.completions.create(model=wire.model, messages=ASK, tools=tools,
                                        tool_choice="required", max_tokens=60)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "tools.0", err


def _history(function: dict[str, Any]) -> Any:
    return [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]


@pytest.mark.parametrize(("function", "says"), [
    ({"name": "f"}, "required"),
    ({"name": "f", "arguments": "[1]"}, "must be a JSON object, got list"),
    ({"name": "f", "arguments": "7"}, "must be a JSON object, got int")])
def test_p1_a_past_calls_arguments_are_required_and_an_object(
        wire: Wire, function: dict[str, Any], says: str) -> None:
    """P1: OpenAI requires a past call's ``arguments`` (a string); a missing one was read as
    ``{}`` and JSON that is no object was handed to the template, which renders an object. Both
    are a 400 naming ``messages.N.tool_calls.M.function.arguments``; so is a Responses
    ``function_call`` item's (``input.N.arguments``)."""
    field = "messages.1.tool_calls.0.function.arguments"
    with pytest.raises(openai.BadRequestError) as e:
        wire.oa.chat.completions.create(model=wire.model, messages=_history(function),
                                        max_tokens=4)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == field, err
    assert err["message"].startswith(field + ": ") and says in err["message"], err
    item: Any = {"type": "function_call", "call_id": "call_1", "name": "f",
                 **({"arguments": function["arguments"]} if "arguments" in function else {})}
    with pytest.raises(openai.BadRequestError) as e:
        wire.oa.responses.create(model=wire.model, max_output_tokens=16, input=[
            {"role": "user", "content": "What time is it?"}, item,
            {"type": "function_call_output", "call_id": "call_1", "output": "noon"}])
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "input.1.arguments", err
    assert says in err["message"], err


def test_p1_a_past_call_with_object_arguments_renders(wire: Wire) -> None:
    """The well-formed history (and ``""``, no arguments) is still answered."""
    for args in ('{"tz": "UTC"}', ""):
        r = wire.oa.chat.completions.create(
            model=wire.model, max_tokens=4,
            messages=_history({"name": "f", "arguments": args}))
        assert r.choices[0].finish_reason in ("length", "stop")
