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
