"""Anthropic ``max_tokens: 0``, the cache pre-warming the current SDK documents ("Set to `0` to
populate the prompt cache without generating a response"), through the official ``anthropic``
client over loopback on SmolLM2 (SPEC P1, L4): the prompt is prefilled into the prefix cache,
the message has empty content, ``stop_reason`` ``max_tokens``, the prompt's input tokens and
0 output tokens, whole and streamed (no content block); the next request with that prompt
reads it from the cache. It was a 400 ("max_tokens: Input should be greater than or equal to
1")."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.conftest import smollm_anthropic, sse_events

# NOTE: a prompt of its own (no other test warms it), long enough to fill whole cache blocks
SYSTEM = "You answer questions about the weather in Lisbon. " * 12


@pytest.fixture(scope="module")
def claude() -> Iterator[tuple[anthropic.Anthropic, str]]:
    yield from smollm_anthropic()


def _ask(question: str) -> Any:
    return [{"role": "user", "content": question}]


def test_p1_max_tokens_0_prefills_the_prompt_and_answers_an_empty_message(
        claude: tuple[anthropic.Anthropic, str]) -> None:
    """P1, L4: ``max_tokens: 0``: empty content, ``stop_reason`` ``max_tokens``, the prompt's
    tokens as input (``count_tokens``'s), 0 output tokens, Coda's ``max_output_tokens``; the
    prompt is in the prefix cache after it (the next request reads it)."""
    client, model = claude
    messages = _ask("Will it rain tomorrow?")
    counted = client.messages.count_tokens(model=model, system=SYSTEM,
                                           messages=messages).input_tokens
    warm = client.messages.create(model=model, max_tokens=0, system=SYSTEM, messages=messages)
    assert warm.content == [] and warm.type == "message" and warm.role == "assistant"
    assert warm.stop_reason == "max_tokens" and warm.stop_sequence is None
    usage = warm.usage
    assert usage.output_tokens == 0
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted
    assert usage.cache_read_input_tokens == 0  # NOTE: nothing warmed this prompt before
    ext: Any = warm.model_extra["coda"]  # type: ignore[index]
    assert ext["finish_reason"] == "max_output_tokens" and ext["usage"]["selected_tokens"] == 0
    after = client.messages.create(model=model, max_tokens=4, system=SYSTEM, messages=messages,
                                   extra_body={"temperature": 0})
    cached = after.usage.cache_read_input_tokens or 0
    assert cached > counted // 2, after.usage  # NOTE: the warmed prefix, whole blocks of it
    assert after.usage.input_tokens + cached == counted
    assert after.usage.output_tokens > 0 and after.content


def test_p1_max_tokens_0_streams_a_message_without_blocks(
        claude: tuple[anthropic.Anthropic, str]) -> None:
    """P1: streamed, ``max_tokens: 0`` is ``message_start``, ``ping``, ``message_delta``
    (``stop_reason`` ``max_tokens``, 0 output tokens) and ``message_stop``: no content block
    (the events Anthropic sends for an empty message); the final message equals the whole
    one's content and stop."""
    client, model = claude
    messages = _ask("Is it windy today?")
    with client.messages.stream(model=model, max_tokens=0, system=SYSTEM,
                                messages=messages) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds == ["message_start", "message_delta", "message_stop"], kinds
    assert final.content == [] and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 0
    counted = client.messages.count_tokens(model=model, system=SYSTEM,
                                           messages=messages).input_tokens
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == counted
    raw = client.messages.with_raw_response.create(
        model=model, max_tokens=0, system=SYSTEM, messages=_ask("Any fog?"), stream=True)
    events = sse_events(raw.http_response.read())  # NOTE: the SDK's iterator skips ping
    assert [e["event"] for e in events] == ["message_start", "ping", "message_delta",
                                            "message_stop"], events


def test_p1_max_tokens_0_with_tools_and_a_negative_one_refused(
        claude: tuple[anthropic.Anthropic, str]) -> None:
    """P1: a pre-warm with tools (the prompt Anthropic caches holds them), a forced tool or a
    structured output is served the same (nothing is generated, so no grammar has to close
    within the budget: it was "max_tokens (0) is too small for the grammar"); a malformed
    ``output_config`` is still its 400, and a negative ``max_tokens`` a 400 naming it."""
    client, model = claude
    tools: Any = [{"name": "weather", "description": "The weather of a city",
                   "input_schema": {"type": "object", "required": ["city"],
                                    "properties": {"city": {"type": "string"}}}}]
    schema: Any = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for extra in ({"tools": tools}, {"tools": tools, "tool_choice": {"type": "any"}},
                  {"output_config": {"format": {"type": "json_schema", "schema": schema}}}):
        warm = client.messages.create(model=model, max_tokens=0, system=SYSTEM,
                                      messages=_ask("And on Sunday?"), **extra)
        assert warm.content == [] and warm.stop_reason == "max_tokens", extra
        assert warm.usage.output_tokens == 0
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=0, messages=_ask("hi"),
                               output_config={"format": {"type": "json_schema"}})
    assert "output_config.format.schema" in str(bad.value)
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=model, max_tokens=-1, messages=_ask("hi"))
    body: Any = exc.value.body
    assert body["error"]["message"].startswith("max_tokens"), body
