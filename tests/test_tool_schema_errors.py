"""A tool whose parameters schema is invalid is a 400 naming the tool (`tools.N`), on Chat
Completions, Responses and Anthropic Messages, not one blaming `response_format` (brief "error
shapes for bad input"; docs/api.md "Tool calling")."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

MODEL = "tiny-chat"
BAD_SCHEMA = {"type": "bogus"}
OK = {"type": "object", "properties": {"city": {"type": "string"}}}
MSG = [{"role": "user", "content": "Weather?"}]


@pytest.fixture
def oai(server_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("choice", ["auto", "required", "none"])
def test_chat_bad_tool_schema_is_400_naming_the_tool(oai: openai.OpenAI, choice: str) -> None:
    tools: Any = [{"type": "function", "function": {"name": "ok", "parameters": OK}},
                  {"type": "function", "function": {"name": "bad", "parameters": BAD_SCHEMA}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSG,  # type: ignore[arg-type]
                                    tools=tools, tool_choice=choice, max_tokens=40)
    err = e.value.body
    assert isinstance(err, dict) and str(err["param"]).startswith("tools"), err
    assert "tools.1" in err["message"] and "response_format" not in err["message"], err


def test_responses_bad_tool_schema_is_400_naming_the_tool(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input="Weather?", max_output_tokens=40,
                             tools=[{"type": "function", "name": "bad",  # type: ignore[list-item]
                                     "parameters": BAD_SCHEMA}])
    err = e.value.body
    assert isinstance(err, dict) and "tools.0" in err["message"], err
    assert "response_format" not in err["message"], err


def test_anthropic_bad_tool_schema_is_400_naming_the_tool(server_live: Any) -> None:
    client = anthropic.Anthropic(base_url=server_live.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=40, messages=MSG,  # type: ignore[arg-type]
                               tools=[{"name": "bad", "input_schema": BAD_SCHEMA}])  # type: ignore[list-item,typeddict-item]
    body = e.value.body
    assert isinstance(body, dict) and body["error"]["type"] == "invalid_request_error", body
    assert "tools.0" in body["error"]["message"], body
    assert "response_format" not in body["error"]["message"], body


def test_anthropic_tool_choice_without_name_says_the_name_is_missing(server_live: Any) -> None:
    client = anthropic.Anthropic(base_url=server_live.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=40, messages=MSG,  # type: ignore[arg-type]
                               tools=[{"name": "f", "input_schema": OK}],  # type: ignore[list-item,typeddict-item]
                               tool_choice={"type": "tool"})  # type: ignore[typeddict-item]
    message = e.value.body["error"]["message"]  # type: ignore[index]
    assert "tool_choice" in message and "name" in message and "None" not in message, message


def test_openai_named_tool_choice_without_name_says_the_name_is_missing(
        oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=40,  # type: ignore[arg-type]
            tools=[{"type": "function", "function": {"name": "f", "parameters": OK}}],
            tool_choice={"type": "function", "function": {}})  # type: ignore[typeddict-item]
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "tool_choice", err
    assert "name" in err["message"] and "None" not in err["message"], err


NOT_OBJECTS = [{"type": "array", "items": {"type": "integer"}}, {"type": "string"},
               {"type": ["object", "null"]}]


@pytest.mark.parametrize("params", NOT_OBJECTS)
def test_chat_tool_parameters_not_an_object_schema_is_400(oai: openai.OpenAI,
                                                          params: dict[str, Any]) -> None:
    """A tool's arguments are a JSON object (OpenAI: "schema must be a JSON Schema of 'type:
    "object"'"); a string or array schema was accepted and, under `required`, its call came back
    as text since a call's `arguments` must be an object (docs/api.md "Tool calling")."""
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=MSG,  # type: ignore[arg-type]
                                    tools=tools, tool_choice="required", max_tokens=40)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "tools.0", err
    assert '"object"' in err["message"], err


def test_chat_tool_parameters_without_type_still_accepted(oai: openai.OpenAI) -> None:
    """Only a `type` other than "object" is refused: `{"properties": ...}` is an object schema."""
    tools: Any = [{"type": "function", "function": {
        "name": "f", "parameters": {"properties": {"a": {"type": "string"}}}}}]
    r = oai.chat.completions.create(model=MODEL, messages=MSG,  # type: ignore[arg-type]
                                    tools=tools, tool_choice="none", max_tokens=8)
    assert r.choices[0].finish_reason in ("tool_calls", "length", "stop")


def test_anthropic_and_responses_input_schema_not_an_object_is_400(
        server_live: Any, oai: openai.OpenAI) -> None:
    """The same rule on Anthropic `input_schema` (its API requires `type: "object"`) and on
    Responses' flat function tools."""
    client = anthropic.Anthropic(base_url=server_live.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as a:
        client.messages.create(model=MODEL, max_tokens=40, messages=MSG,  # type: ignore[arg-type]
                               tools=[{"name": "f", "input_schema": {"type": "string"}}])  # type: ignore[list-item,typeddict-item]
    assert "tools.0" in a.value.body["error"]["message"], a.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as r:
        oai.responses.create(model=MODEL, input="Weather?", max_output_tokens=40,
                             tools=[{"type": "function", "name": "f",  # type: ignore[list-item]
                                     "parameters": {"type": "array"}}])
    assert isinstance(r.value.body, dict) and "tools.0" in r.value.body["message"], r.value.body
