"""What a demanding user of the OpenAI and Anthropic APIs sends, through the official clients
over loopback (the API-gaps issue items 1 and 3; SPEC P1, L6): fields the real APIs accept
(``service_tier``, ``prompt_cache_key``, ``safety_identifier``, ``modalities``,
``reasoning_effort``), the deprecated ``functions`` / ``function_call`` answered in their own
shape, and a tool result that answers no call refused as upstream refuses it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.reasoning_support import CHAIN, OPEN_ID, reasoning_model_dir
from tests.tools_support import Wire, serve
from tests.wire_support import ScriptedServer, scripted_server

MODEL = "tiny-chat"
MSG: Any = [{"role": "user", "content": "Hello world"}]
ZONE = {"type": "object", "required": ["zone"], "additionalProperties": False,
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
FUNCTIONS: Any = [{"name": "get_time", "description": "The time", "parameters": ZONE}]


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    """The embedded default model (its context holds a tool prompt; tiny-chat's does not)."""
    yield from serve()


@pytest.fixture(scope="module")
def fn(wire: Wire) -> tuple[openai.OpenAI, str]:
    return wire.oa, wire.model


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    root: Path = tmp_path_factory.mktemp("effort")
    yield from scripted_server(CHAIN, model_dir=reasoning_model_dir(root, inside=True),
                               first=CHAIN[OPEN_ID])


def _param(exc: pytest.ExceptionInfo[openai.BadRequestError]) -> Any:
    return exc.value.body["param"]  # type: ignore[index]


# -- item 1: fields accepted as upstream accepts them ---------------------------------------
def test_p1_service_tier_is_answered_default_whole_and_streamed(oa: openai.OpenAI) -> None:
    """P1: ``service_tier`` (any of OpenAI's values) is served in the one local tier and the
    answer says so, as OpenAI reports the tier it used: ``"default"`` on the completion, on
    every chunk and on the Responses object; not asked, not reported. A value OpenAI does not
    know is a 400 naming the field."""
    r = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, service_tier="flex")
    assert r.service_tier == "default"
    chunks = list(oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                             service_tier="priority", stream=True))
    assert chunks and all(c.service_tier == "default" for c in chunks)
    assert oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).service_tier \
        is None
    resp = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                               service_tier="auto")
    assert resp.service_tier == "default"
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                   service_tier="gold")  # type: ignore[arg-type]
    assert _param(exc) == "service_tier"


def test_p1_anthropic_service_tier_is_answered_standard(an: anthropic.Anthropic) -> None:
    """P1: Anthropic's ``service_tier`` (``auto`` | ``standard_only``) is accepted and the
    usage reports the tier used, ``"standard"``, whole and in the stream's ``message_start``
    and ``message_delta``; not asked, not reported; another value is a 400."""
    m = an.messages.create(model=MODEL, messages=MSG, max_tokens=2, service_tier="auto")
    assert m.usage.service_tier == "standard"
    with an.messages.stream(model=MODEL, messages=MSG, max_tokens=2,
                            service_tier="standard_only") as stream:
        events = list(stream)
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    assert start.message.usage.service_tier == "standard"
    assert (delta.usage.model_extra or {}).get("service_tier") == "standard"
    assert an.messages.create(model=MODEL, messages=MSG, max_tokens=2).usage.service_tier \
        is None
    with pytest.raises(anthropic.BadRequestError) as exc:
        an.messages.create(model=MODEL, messages=MSG, max_tokens=2,
                           service_tier="priority")  # type: ignore[arg-type]
    assert "service_tier" in str(exc.value)


def test_p1_cache_key_safety_id_text_modality_are_accepted(oa: openai.OpenAI) -> None:
    """P1: ``prompt_cache_key`` and ``safety_identifier`` (nothing local corresponds: prefix
    caching is automatic) and ``modalities: ["text"]`` are accepted on chat (and the first two
    on Responses) and change nothing: the seeded answer is the same bytes."""
    plain = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, seed=3)
    keyed = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, seed=3,
                                       prompt_cache_key="conv-1", safety_identifier="u-1",
                                       modalities=["text"])
    assert keyed.choices[0].message.content == plain.choices[0].message.content
    resp = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                               prompt_cache_key="conv-1", safety_identifier="u-1")
    assert resp.status in ("completed", "incomplete")


def test_p1_audio_modality_is_a_400_saying_why(oa: openai.OpenAI) -> None:
    """P1: asking for audio output is a 400 naming ``modalities`` (the model writes text)."""
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                   modalities=["text", "audio"],
                                   audio={"voice": "alloy", "format": "wav"})
    assert _param(exc) in ("modalities", "audio")
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2,
                                   modalities=["audio"])
    assert _param(exc) == "modalities" and "audio" in str(exc.value)


def test_p1_reasoning_effort_is_ignored_on_a_model_without_reasoning(oa: openai.OpenAI) -> None:
    """P1: on a model with no reasoning markers ``reasoning_effort`` has nothing to bound: it
    is accepted and the seeded answer is unchanged (docs/api.md)."""
    plain = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, seed=5)
    for effort in ("none", "minimal", "high", "max"):
        r = oa.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, seed=5,
                                       reasoning_effort=effort)  # type: ignore[arg-type]
        assert r.choices[0].message.content == plain.choices[0].message.content


def test_k2_reasoning_effort_none_bounds_the_reasoning_budget(r1: ScriptedServer) -> None:
    """K2: on a reasoning model ``reasoning_effort`` is the reasoning budget: ``"none"`` forces
    the closer at once (no reasoning, the answer follows), on chat and on Responses'
    ``reasoning.effort``; ``"max"`` sets no budget (the scripted reasoning runs its course);
    ``max_reasoning_tokens`` given with it wins."""
    client = openai.OpenAI(base_url=r1.url + "/v1", api_key="k", max_retries=0)
    model = client.models.list().data[0].id
    ask: Any = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=model, messages=ask, reasoning_effort="none")
    split = (r.choices[0].model_extra or {})["coda"]["reasoning"]
    assert split["forced"] is True and split["bytes"] == 0
    assert r.choices[0].message.content == " there."
    free = client.chat.completions.create(model=model, messages=ask, reasoning_effort="max")
    assert (free.choices[0].model_extra or {})["coda"]["reasoning"]["forced"] is False
    wins = client.chat.completions.create(model=model, messages=ask, reasoning_effort="none",
                                          extra_body={"max_reasoning_tokens": 1})
    assert (wins.choices[0].message.model_extra or {})["reasoning"] == " me"
    resp = client.responses.create(model=model, input="hi", reasoning={"effort": "none"})
    assert resp.model_extra and resp.model_extra["coda"]["reasoning"]["forced"] is True
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=model, input="hi",
                                reasoning={"effort": "huge"})  # type: ignore[typeddict-item]
    assert _param(exc) == "reasoning.effort"


# -- item 1: the deprecated function calling -------------------------------------------------
def _valid_call(call: Any) -> None:
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), ZONE)


def test_s1_legacy_functions_answer_message_function_call(
        fn: tuple[openai.OpenAI, str]) -> None:
    """S1: ``functions`` + ``function_call: {"name"}`` force that function as tools would, and
    the answer is the legacy shape: ``message.function_call`` (name, arguments valid against
    the schema), no ``tool_calls``, ``finish_reason: "function_call"``; streamed, one
    ``delta.function_call`` and the same finish reason."""
    oa, model = fn
    r = oa.chat.completions.create(model=model, messages=MSG, functions=FUNCTIONS,
                                   function_call={"name": "get_time"}, max_tokens=60, seed=1)
    choice = r.choices[0]
    assert choice.finish_reason == "function_call"
    assert choice.message.tool_calls is None and choice.message.function_call is not None
    _valid_call(choice.message.function_call)
    chunks = list(oa.chat.completions.create(
        model=model, messages=MSG, functions=FUNCTIONS, function_call={"name": "get_time"},
        max_tokens=60, seed=1, stream=True))
    calls = [c.choices[0].delta.function_call for c in chunks
             if c.choices and c.choices[0].delta.function_call]
    assert len(calls) == 1 and not any(c.choices[0].delta.tool_calls for c in chunks
                                       if c.choices)
    _valid_call(calls[0])
    assert calls[0].arguments == choice.message.function_call.arguments
    assert chunks[-1].choices[0].finish_reason == "function_call"


def test_legacy_function_history_round_trip_and_bad_mixes(
        fn: tuple[openai.OpenAI, str]) -> None:
    """A legacy conversation (assistant ``function_call``, then a ``function`` message with the
    result) is rendered as tool history; ``function_call: "none"`` answers text. Mixing styles
    or ``function_call`` without ``functions`` is a 400 naming the field."""
    oa, model = fn
    history: Any = [*MSG, {"role": "assistant", "content": None,
                           "function_call": {"name": "get_time",
                                             "arguments": '{"zone": "UTC"}'}},
                    {"role": "function", "name": "get_time", "content": "12:00"}]
    r = oa.chat.completions.create(model=model, messages=history, functions=FUNCTIONS,
                                   function_call="none", max_tokens=4)
    assert r.choices[0].message.function_call is None
    assert r.choices[0].finish_reason in ("stop", "length")
    tools: Any = [{"type": "function", "function": FUNCTIONS[0]}]
    for kw, param in (({"function_call": "auto"}, "function_call"),
                      ({"functions": FUNCTIONS, "tools": tools}, "functions")):
        with pytest.raises(openai.BadRequestError) as exc:
            oa.chat.completions.create(model=model, messages=MSG, max_tokens=2, **kw)
        assert _param(exc) == param
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=model, max_tokens=2, messages=[
            *MSG, {"role": "function", "name": "get_time", "content": "12:00"}])
    assert _param(exc) == "messages.1.role"


# -- item 3: a tool result must answer a call ------------------------------------------------
def test_p1_openai_tool_message_with_unknown_id_is_a_400(oa: openai.OpenAI) -> None:
    """P1: a ``tool`` message whose ``tool_call_id`` no preceding assistant ``tool_calls``
    issued is a 400 naming that message (OpenAI's check); the matching id is accepted."""
    call: Any = {"id": "call_a", "type": "function",
                 "function": {"name": "get_time", "arguments": "{}"}}
    good: Any = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "tool_call_id": "call_a", "content": "12:00"}]
    assert oa.chat.completions.create(model=MODEL, messages=good, max_tokens=2).choices
    for messages, at in (
            ([*MSG, {"role": "tool", "tool_call_id": "call_a", "content": "12:00"}], 1),
            ([*good[:2], {"role": "tool", "tool_call_id": "call_b", "content": "x"}], 2),
            ([*good, *MSG, {"role": "tool", "tool_call_id": "call_a", "content": "x"}], 4)):
        with pytest.raises(openai.BadRequestError) as exc:
            oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert _param(exc) == f"messages.{at}.tool_call_id"
        assert f"messages.{at}" in str(exc.value)


def test_p1_responses_output_with_unknown_call_id_is_a_400(oa: openai.OpenAI) -> None:
    """P1: a ``function_call_output`` whose ``call_id`` no ``function_call`` before it made is
    a 400 naming the item; after its call it is accepted."""
    out: Any = {"type": "function_call_output", "call_id": "call_x", "output": "12:00"}
    with pytest.raises(openai.BadRequestError) as exc:
        oa.responses.create(model=MODEL, input=[out], max_output_tokens=16)
    assert _param(exc) == "input.0.call_id"
    made: Any = {"type": "function_call", "call_id": "call_x", "name": "get_time",
                 "arguments": "{}"}
    assert oa.responses.create(model=MODEL, input=[made, out], max_output_tokens=16).id


def test_p1_anthropic_tool_result_with_unknown_id_is_a_400(an: anthropic.Anthropic,
                                                           server_live: Any) -> None:
    """P1: a ``tool_result`` whose ``tool_use_id`` the previous message did not issue is a 400
    in Anthropic's shape naming the message and block (Messages and count_tokens); the
    matching id is accepted."""
    use: Any = {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}]}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "12:00"}
    good: Any = [*MSG, use, {"role": "user", "content": [result]}]
    assert an.messages.create(model=MODEL, max_tokens=2, messages=good).content is not None
    bad: Any = [*MSG, use, {"role": "user", "content": [{**result, "tool_use_id": "toolu_9"}]}]
    orphan: Any = [{"role": "user", "content": [result]}]
    for messages, at in ((bad, "messages.2.content.0"), (orphan, "messages.0.content.0")):
        with pytest.raises(anthropic.BadRequestError) as exc:
            an.messages.create(model=MODEL, max_tokens=2, messages=messages)
        body: Any = exc.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert at in body["error"]["message"]
    resp = httpx.post(server_live.url + "/v1/messages/count_tokens",
                      json={"model": MODEL, "messages": bad}, timeout=30)
    assert resp.status_code == 400 and "messages.2" in resp.json()["error"]["message"]


# -- item 5: chat-only fields on the legacy completions endpoint ------------------------------
@pytest.mark.parametrize("field", ["tools", "tool_choice", "parallel_tool_calls", "functions",
                                   "messages", "max_completion_tokens"])
def test_p1_chat_only_field_on_completions_is_a_400_naming_it(oa: openai.OpenAI,
                                                              field: str) -> None:
    """P1: ``/v1/completions`` has no tools (nor messages, nor the chat budget's name): a
    chat-only field is a 400 in OpenAI's shape, ``Unrecognized request argument supplied:
    <field>`` with ``param`` the field, as OpenAI answers — never silently ignored."""
    value: Any = {"tools": [{"type": "function", "function": {"name": "get_time",
                                                              "parameters": ZONE}}],
                  "tool_choice": "auto", "parallel_tool_calls": True, "functions": FUNCTIONS,
                  "messages": MSG, "max_completion_tokens": 2}[field]
    with pytest.raises(openai.BadRequestError) as exc:
        oa.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                              extra_body={field: value})
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == field
    assert body["message"] == f"Unrecognized request argument supplied: {field}"
