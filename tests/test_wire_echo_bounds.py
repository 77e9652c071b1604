"""What the Responses object echoes and the bounds OpenAI and Anthropic put on informational
fields, through the official clients over loopback (SPEC P1). Found by probing SmolLM2 and
Gemma 3 with the clients: a response echoed ``parallel_tool_calls: false`` (OpenAI's default
is true; sent true without tools it still said false) and ``temperature`` / ``top_p`` null
(sampled at 1.0); a ``metadata`` of 17 pairs, a 65-character key or a 513-character value was
stored and echoed (OpenAI: 16 pairs, keys <= 64, values <= 512); Anthropic's
``metadata.user_id`` had no bound (256); a malformed ``system`` block named
``system.content.0`` (no such path) and said "got 'text'" of a text block without text; an
empty system text block (Anthropic: 400, "system: text content blocks must be non-empty") was
served as an empty system turn, which replaced the template's default system prompt."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest

from tests.test_server_openai import MODEL

Q: Any = [{"role": "user", "content": "hi"}]


def test_p1_responses_echo_parallel_tool_calls_temperature_and_top_p(
        oa: openai.OpenAI) -> None:
    """P1: not sent, the response says what was used: ``parallel_tool_calls`` true,
    ``temperature`` and ``top_p`` 1.0; sent, it says what was sent: on create, in the
    stream's created event and on retrieve."""
    plain = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    assert (plain.parallel_tool_calls, plain.temperature, plain.top_p) == (True, 1.0, 1.0)
    sent = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                               parallel_tool_calls=False, temperature=0.5, top_p=0.25)
    assert (sent.parallel_tool_calls, sent.temperature, sent.top_p) == (False, 0.5, 0.25)
    got = oa.responses.retrieve(sent.id)
    assert (got.parallel_tool_calls, got.temperature, got.top_p) == (False, 0.5, 0.25)
    events = list(oa.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                                      parallel_tool_calls=True, stream=True))
    first = events[0].response  # type: ignore[union-attr]
    assert (first.parallel_tool_calls, first.temperature, first.top_p) == (True, 1.0, 1.0)


def test_p1_responses_echo_parallel_tool_calls_with_tools(oa: openai.OpenAI) -> None:
    """P1: with tools the echo is the request's too (default true, false when sent);
    ``tool_choice: none`` (the tiny model's tokenizer builds no tool grammar)."""
    tools: Any = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    on = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16, tools=tools,
                             tool_choice="none")
    off = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16, tools=tools,
                              tool_choice="none", parallel_tool_calls=False)
    assert (on.parallel_tool_calls, off.parallel_tool_calls) == (True, False)


BAD_METADATA = [({f"k{i}": "v" for i in range(17)}, "metadata", "too many"),
                ({"k" * 65: "v"}, "metadata", "too long"),
                ({"k": "v" * 513}, "metadata.k", "too long")]


@pytest.mark.parametrize(("metadata", "param", "says"), BAD_METADATA,
                         ids=["17_pairs", "key_65", "value_513"])
def test_p1_metadata_past_openais_bounds_is_a_400(
        oa: openai.OpenAI, metadata: dict[str, str], param: str, says: str) -> None:
    """P1: on Responses and chat, as OpenAI's: a 400 naming the field."""
    for call in (lambda: oa.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                                             metadata=metadata),
                 lambda: oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=2,
                                                    metadata=metadata)):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        body: Any = info.value.body
        assert body["param"] == param and says in body["message"], body


def test_p1_metadata_at_openais_bounds_is_served(oa: openai.OpenAI) -> None:
    full = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    r = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16, metadata=full)
    assert r.metadata == full
    chat = oa.chat.completions.create(model=MODEL, messages=Q, max_tokens=2, metadata=full)
    assert chat.choices[0].finish_reason is not None


def test_p1_anthropic_user_id_is_at_most_256_characters(an: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        an.messages.create(model=MODEL, max_tokens=2, messages=Q,
                           metadata={"user_id": "u" * 257})
    assert "metadata.user_id" in info.value.body["error"]["message"]  # type: ignore[index]
    ok = an.messages.create(model=MODEL, max_tokens=2, messages=Q,
                            metadata={"user_id": "u" * 256})
    assert ok.type == "message"


@pytest.mark.parametrize(("system", "field", "says"), [
    ([{"type": "text"}], "system.0.text", "Field required"),
    ([{"type": "text", "text": 3}], "system.0.text", "valid string"),
    ([{"type": "text", "text": "be brief"}, {"type": "image", "source": {}}], "system.1.type",
     "'image'"),
    ([{"text": "be brief"}], "system.0.type", "None"),
    ([{"type": "text", "text": "be brief"}, {"type": "text", "text": ""}], "system.1.text",
     "text content blocks must be non-empty"),
], ids=["no_text", "text_not_a_string", "image", "no_type", "empty_text"])
def test_p1_anthropic_system_block_errors_name_its_path(
        an: anthropic.Anthropic, system: Any, field: str, says: str) -> None:
    """P1: a bad ``system`` block is a 400 naming ``system.{j}.…`` (create and
    ``count_tokens``); text blocks (with ``cache_control``) are served as one string, the
    blocks apart by a blank line (as every turn's text blocks: coda.server.tool_messages)."""
    with pytest.raises(anthropic.BadRequestError) as info:
        an.messages.create(model=MODEL, max_tokens=2, messages=Q, system=system)
    message = info.value.body["error"]["message"]  # type: ignore[index]
    assert message.startswith(field + ":") and says in message, message
    with pytest.raises(anthropic.BadRequestError):
        an.messages.count_tokens(model=MODEL, messages=Q, system=system)
    blocks: Any = [{"type": "text", "text": "be", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "brief"}]
    assert (an.messages.count_tokens(model=MODEL, messages=Q, system=blocks).input_tokens
            == an.messages.count_tokens(model=MODEL, messages=Q,
                                        system="be\n\nbrief").input_tokens)


def test_p1_a_completed_response_says_when_it_completed(oa: openai.OpenAI) -> None:
    """P1: ``completed_at`` (OpenAI: only when the status is completed) is set on a completed
    response, not before its creation, the same on retrieve and in ``response.completed``;
    an incomplete one has none."""
    stops = ["e", "a", "o", " "]
    done = oa.responses.create(model=MODEL, input="hi", max_output_tokens=64, temperature=0,
                               extra_body={"stop": stops})
    assert done.status == "completed", done.model_dump()
    assert done.completed_at is not None and done.completed_at >= done.created_at
    assert oa.responses.retrieve(done.id).completed_at == done.completed_at
    events = list(oa.responses.create(model=MODEL, input="hi", max_output_tokens=64,
                                      temperature=0, stream=True, extra_body={"stop": stops}))
    last = events[-1]
    assert last.type == "response.completed" and last.response.completed_at is not None
    assert events[0].response.completed_at is None  # type: ignore[union-attr]
    cut = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                            extra_body={"ignore_eos": True})
    assert cut.status == "incomplete" and cut.completed_at is None


def test_p1_responses_echo_the_informational_fields_as_sent(oa: openai.OpenAI) -> None:
    """P1: ``user``, ``safety_identifier``, ``prompt_cache_key``, ``top_logprobs`` and
    ``reasoning`` come back as sent (null where not sent), on create and on retrieve (the
    SDK read None for every one)."""
    sent = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16, user="u1",
                               safety_identifier="s1", prompt_cache_key="k1", top_logprobs=2,
                               reasoning={"effort": "low"})
    for r in (sent, oa.responses.retrieve(sent.id)):
        assert (r.user, r.safety_identifier, r.prompt_cache_key, r.top_logprobs) == (
            "u1", "s1", "k1", 2)
        assert r.reasoning is not None and r.reasoning.effort == "low"
        assert r.reasoning.summary is None
    plain = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    assert (plain.user, plain.safety_identifier, plain.prompt_cache_key,
            plain.top_logprobs) == (None, None, None, None)
    assert plain.reasoning is not None and plain.reasoning.effort is None
