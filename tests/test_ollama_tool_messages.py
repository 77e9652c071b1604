"""Ollama ``/api/chat`` tool messages (the API-gaps issue item 4; SPEC P1) through the official
``ollama`` client (and raw HTTP for the shapes the client itself refuses to send), on the real
SmolLM2 model: a ``{"role": "tool", "content", "tool_name"}`` result after an assistant's
``tool_calls`` is rendered into the prompt through the model's template; a shape the template
would drop or misrender is a 400 ``{"error": "..."}`` naming the field.
"""

from __future__ import annotations

from typing import Any

import httpx
import ollama
import pytest

from coda.server.chat import render_chat
from coda.server.ollama_schemas import OllamaMessage
from coda.server.ollama_wire import chat_messages
from tests.tools_support import OLLAMA_WEATHER as WEATHER

ASK: dict[str, Any] = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
ASSISTANT: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [CALL]}
RESULT: dict[str, Any] = {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}


def test_p1_tool_result_is_rendered_into_the_prompt(
        smollm_engine: Any, smollm_live: Any, smollm_ollama: ollama.Client,
        smollm_name: str) -> None:
    """A tool result (with and without ``tool_name``) after the assistant's call is accepted
    and rendered: its text is in the template's output, and it adds to the prompt the model
    was given (``prompt_eval_count``)."""
    msgs = [ASK, ASSISTANT, RESULT]
    text = render_chat(smollm_engine, chat_messages([OllamaMessage(**m) for m in msgs]),
                       tools=())
    assert "sunny, 21 C" in text and "get_weather" in text and '"city": "Paris"' in text
    opts = {"temperature": 0, "num_predict": 1}

    def prompt_tokens(messages: list[dict[str, Any]]) -> int:
        assert smollm_ollama.chat(model=smollm_name, messages=messages, tools=[WEATHER],
                                  stream=False, options=opts).done
        r = httpx.post(smollm_live.url + "/api/chat", timeout=60, json={
            "model": smollm_name, "messages": messages, "tools": [WEATHER], "stream": False,
            "options": opts}).json()
        # NOTE: the whole prompt (prompt_eval_count leaves out what the prefix cache held)
        return int(r["coda"]["usage"]["prompt_tokens"])

    without = prompt_tokens([ASK, ASSISTANT])
    assert prompt_tokens([ASK, ASSISTANT, RESULT]) > without
    nameless = {k: v for k, v in RESULT.items() if k != "tool_name"}
    assert prompt_tokens([ASK, ASSISTANT, nameless]) > without


BAD: list[tuple[str, list[dict[str, Any]], str, str]] = [
    ("arguments a JSON string", [ASK, {**ASSISTANT, "tool_calls": [
        {"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}, RESULT],
     "messages.1.tool_calls.0.function.arguments", "dictionary"),
    ("a call without a name", [ASK, {**ASSISTANT, "tool_calls": [
        {"function": {"arguments": {}}}]}, RESULT],
     "messages.1.tool_calls.0.function.name", "required"),
    ("a call not wrapped in function", [ASK, {**ASSISTANT, "tool_calls": [
        {"name": "get_weather", "arguments": {}}]}, RESULT],
     "messages.1.tool_calls.0.function", "required"),
    ("tool_calls on a tool result", [ASK, ASSISTANT, {**RESULT, "tool_calls": [CALL]}],
     "messages.2", "only an assistant message carries tool calls"),
    ("tool_calls on a user message", [{**ASK, "tool_calls": [CALL]}],
     "messages.0", "only an assistant message carries tool calls"),
    ("tool_name on a user message", [{**ASK, "tool_name": "get_weather"}],
     "messages.0", "only a tool result (role 'tool') names its tool"),
    ("a result that is not text", [ASK, ASSISTANT, {**RESULT, "content": {"temp": 21}}],
     "messages.2.content", "string"),
    ("tool_name not a string", [ASK, ASSISTANT, {**RESULT, "tool_name": 5}],
     "messages.2.tool_name", "string"),
]


@pytest.mark.parametrize(("why", "messages", "field", "word"), BAD, ids=[b[0] for b in BAD])
def test_p1_malformed_tool_messages_are_a_400_in_ollama_shape(
        smollm_live: Any, smollm_ollama: ollama.Client, smollm_name: str, why: str,
        messages: list[dict[str, Any]], field: str, word: str) -> None:
    """P1: each malformed shape is a 400 whose body is exactly ``{"error": "..."}`` naming the
    field; the official client (where it lets the shape through) raises ResponseError 400."""
    body = {"model": smollm_name, "messages": messages, "stream": False}
    resp = httpx.post(smollm_live.url + "/api/chat", json=body, timeout=60)
    assert resp.status_code == 400, why
    error = resp.json()
    assert list(error) == ["error"] and error["error"].startswith(field + ":")
    assert word in error["error"]
    try:  # NOTE: the client validates some shapes itself (arguments a Mapping, name a str)
        [ollama.Message(**m) for m in messages]
    except (ValueError, TypeError):
        return
    with pytest.raises(ollama.ResponseError) as exc:
        smollm_ollama.chat(model=smollm_name, messages=messages, stream=False)
    assert exc.value.status_code == 400 and word in exc.value.error


def test_p1_null_arguments_are_no_arguments(smollm_engine: Any) -> None:
    """``"arguments": null`` reads as no arguments (as Ollama decodes a null map): accepted and
    rendered as ``{}``, while a call echoed back with Ollama's ``index`` and an ``id`` keeps
    its arguments."""
    call: dict[str, Any] = {"function": {"name": "get_weather", "arguments": None}}
    m = OllamaMessage(role="assistant", tool_calls=[call])  # type: ignore[list-item]
    assert m.template_calls() == [{"function": {"name": "get_weather", "arguments": {}}}]
    text = render_chat(smollm_engine, chat_messages([OllamaMessage(**ASK), m]), tools=())
    assert '"arguments": {}' in text
    echo: Any = [{"id": "call_1", "function": {"index": 0, **CALL["function"]}}]
    echoed = OllamaMessage(role="assistant", tool_calls=echo)
    assert echoed.template_calls() == [{"id": "call_1", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}, "index": 0}}]
