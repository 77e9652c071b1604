"""A schema whose ``$ref`` admits no finite JSON value is a 400 naming its field (SPEC P1;
docs/api.md "Structured output that closes within the budget"), on every protocol field that
takes a schema, streamed or not.

Found by the structured-output sweep (SmolLM2, Gemma 3): llguidance compiles such a schema
(``{"$defs": {"n": {"$ref": "#/$defs/n"}}}``, two definitions naming each other, a node that
requires a child of its own kind), the output then reaches a point where no token continues it,
and the request ended there as a natural ``stop`` / ``end_turn`` / ``completed`` holding
``{"a":`` or nothing at all.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from coda.engine.grammar_schema import schema_problem

MSG: Any = [{"role": "user", "content": "json please"}]
SELF: Any = {"type": "object", "$defs": {"n": {"$ref": "#/$defs/n"}},
             "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}
ENDLESS: dict[str, Any] = {
    "self": SELF,
    "root": {"$defs": {"n": {"$ref": "#/$defs/n"}}, "$ref": "#/$defs/n"},
    "mutual": {"type": "object", "$defs": {"n": {"$ref": "#/$defs/m"}, "m": {"$ref": "#/$defs/n"}},
               "properties": {"a": {"$ref": "#/$defs/n"}}},
    "allof": {"$defs": {"n": {"allOf": [{"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"},
    "required_child": {"type": "object", "properties": {"kid": {"$ref": "#"}}, "required": ["kid"]},
    "nonempty_list": {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"},
                                      "minItems": 1}}, "$ref": "#/$defs/n"},
    "tuple": {"$defs": {"t": {"type": "array", "minItems": 2,
                              "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/t"}]}},
              "$ref": "#/$defs/t"},
}
FINITE: dict[str, Any] = {
    "tree": {"$defs": {"n": {"type": "object", "required": ["v", "kids"], "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
             "$ref": "#/$defs/n"},
    "list": {"$defs": {"l": {"anyOf": [{"type": "null"}, {"type": "object", "required": ["next"],
                                                          "properties": {"next": {"$ref": "#/$defs/l"}}}]}},
             "$ref": "#/$defs/l"},
    "left": {"$defs": {"n": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "integer"}]}},
             "$ref": "#/$defs/n"},
    "optional_child": {"type": "object", "properties": {"kid": {"$ref": "#"}}},
    "tuple": {"$defs": {"t": {"type": "array", "minItems": 1,
                              "prefixItems": [{"type": "integer"}, {"$ref": "#/$defs/t"}]}},
              "$ref": "#/$defs/t"},
    "escaped": {"$defs": {"a/b": {"type": "string"}}, "$ref": "#/$defs/a~1b"},
    "unresolved": {"$ref": "#/$defs/missing"},  # NOTE: llguidance's own 400, not this check's
    # NOTE: an anchor is no pointer: never read as the root (which requires it here)
    "anchor": {"type": "object", "properties": {"k": {"$ref": "#leaf"}}, "required": ["k"],
               "$defs": {"leaf": {"$anchor": "leaf", "type": "integer"}}},
}


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_p1_a_ref_with_no_finite_value_is_named(name: str) -> None:
    """P1: the pure check finds each endless ref (the least fixed point of "has a value")."""
    problem = schema_problem(ENDLESS[name])
    assert problem and "admits no finite JSON value" in problem, problem


@pytest.mark.parametrize("name", sorted(FINITE))
def test_p1_a_recursive_schema_with_a_way_out_is_served(name: str) -> None:
    """P1: recursion that can end (an optional or anyOf branch, maxItems 0 room) is no
    problem: only what surely has no value is refused."""
    assert schema_problem(FINITE[name]) is None


def _openai_400(call: Any, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    body = e.value.body
    assert isinstance(body, dict) and "admits no finite JSON value" in body["message"], body
    assert field in body["message"], body


def test_p1_every_schema_field_refuses_an_endless_ref(smollm_live: Any, smollm_name: str) -> None:
    """P1: response_format (streamed too), a chat tool, Responses text.format and a function
    tool, Anthropic output_config.format and input_schema, Ollama format (chat, generate) and
    tools: each a 400 in its protocol's shape, never an answer."""
    oai = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="x", max_retries=0)
    rf: Any = {"type": "json_schema", "json_schema": {"name": "x", "schema": SELF}}
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": SELF}}]
    # NOTE: SmolLM2: the tiny fixture's tokenizer is one llguidance cannot take at all
    _openai_400(lambda: oai.chat.completions.create(
        model=smollm_name, messages=MSG, max_tokens=8, response_format=rf), "response_format")
    _openai_400(lambda: oai.chat.completions.create(
        model=smollm_name, messages=MSG, max_tokens=8, response_format=rf, stream=True),
        "response_format")
    _openai_400(lambda: oai.chat.completions.create(
        model=smollm_name, messages=MSG, max_tokens=8, tools=tools, tool_choice="required"), "tools.0")
    _openai_400(lambda: oai.responses.create(
        model=smollm_name, input="json", max_output_tokens=16,
        text={"format": {"type": "json_schema", "name": "x", "schema": SELF}}), "text.format")
    _openai_400(lambda: oai.responses.create(
        model=smollm_name, input="json", max_output_tokens=16,
        tools=[{"type": "function", "name": "f", "parameters": SELF, "strict": False}]),
        "tools.0")
    ant = anthropic.Anthropic(base_url=smollm_live.url, api_key="x", max_retries=0)
    for extra in ({"extra_body": {"output_config": {"format": {"type": "json_schema",
                                                                "schema": SELF}}}},
                  {"tools": [{"name": "f", "input_schema": SELF}], "tool_choice": {"type": "any"}}):
        with pytest.raises(anthropic.BadRequestError) as ae:
            ant.messages.create(model=smollm_name, max_tokens=8, messages=MSG, **extra)
        abody = ae.value.body
        assert isinstance(abody, dict) and abody["error"]["type"] == "invalid_request_error"
        assert "admits no finite JSON value" in abody["error"]["message"], abody
    oll = ollama.Client(host=smollm_live.url)
    for call in (lambda: oll.chat(model=smollm_name, messages=MSG, format=SELF),
                 lambda: oll.generate(model=smollm_name, prompt="json", format=SELF),
                 lambda: oll.chat(model=smollm_name, messages=MSG, tools=tools)):
        with pytest.raises(ollama.ResponseError) as oe:
            call()
        assert oe.value.status_code == 400 and "admits no finite JSON value" in oe.value.error


def test_p1_a_recursive_schema_with_a_way_out_still_answers(smollm_live: Any,
                                                             smollm_name: str) -> None:
    """P1: the check refuses nothing servable: a tree of nodes answers JSON that parses."""
    r = httpx.post(smollm_live.url + "/v1/chat/completions", timeout=60, json={
        "model": smollm_name, "messages": MSG, "max_tokens": 60, "seed": 1,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "t", "schema": FINITE["tree"]}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
