"""The newer Messages fields of the official ``anthropic`` client, each through the client over
loopback (SPEC P1; K2 for the reasoning display):

- ``thinking.display: "omitted"`` sends each thinking block with its signature and empty
  ``thinking`` text, streamed as a block start and its ``signature_delta`` with no
  ``thinking_delta`` (it was ignored: the reasoning was sent in full); another ``display`` or a
  key the thinking type does not take is a 400 naming it (both were accepted);
- ``thinking: {"type": "between_tools"}`` is served as thinking off (it was a 400);
- ``speed`` (reported as ``usage.speed: "standard"``), ``inference_geo`` and ``diagnostics``
  (answered ``diagnostics: null``) are accepted hints (each was "Extra inputs are not
  permitted", so a client sending them could not talk to Coda at all);
- ``container``, ``context_management`` and ``mcp_servers`` ask for what only Anthropic's
  servers do: a 400 naming the field and saying what to do instead (they were refused as
  unknown fields, as if misspelled); null passes;
- every Anthropic error body carries ``request_id``, the id of its ``request-id`` header (the
  SDK's ``ErrorResponse.request_id``; it was missing from the body).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import smollm_anthropic
from tests.reasoning_support import CHAIN, OPEN_ID, reasoning_model_dir
from tests.wire_support import ScriptedServer, scripted_server

MSG: Any = [{"role": "user", "content": "hi"}]
REASONING, ANSWER = " me think", " there."  # NOTE: the r1 script (tests/test_reasoning_wire.py)


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    root: Path = tmp_path_factory.mktemp("reasoning")
    yield from scripted_server(CHAIN, model_dir=reasoning_model_dir(root, inside=True),
                               first=CHAIN[OPEN_ID])


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[anthropic.Anthropic, str]]:
    yield from smollm_anthropic()


def _claude(server: ScriptedServer) -> tuple[anthropic.Anthropic, str]:
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0), str(model)


def _refused(call: Any) -> tuple[str, Any]:
    with pytest.raises(anthropic.BadRequestError) as exc:
        call()
    body: Any = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return str(body["error"]["message"]), body


@pytest.mark.parametrize("kind", ["enabled", "adaptive"])
def test_k2_p1_display_omitted_sends_the_block_without_its_text(r1: ScriptedServer,
                                                                kind: str) -> None:
    """K2, P1: ``display: "omitted"``: the thinking block is there, signature and all, with
    empty text, whole and streamed (no ``thinking_delta``); the answer is unchanged."""
    client, model = _claude(r1)
    thinking: Any = {"type": kind, "display": "omitted"}
    extra: Any = {"max_reasoning_tokens": 50} if kind == "enabled" else None
    msg = client.messages.create(model=model, max_tokens=50, messages=MSG, thinking=thinking,
                                 extra_body=extra)
    assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
    block: Any = msg.content[0]
    assert block.thinking == "" and block.signature == ""
    assert msg.content[1].text == ANSWER  # type: ignore[union-attr]
    with client.messages.stream(model=model, max_tokens=50, messages=MSG, thinking=thinking,
                                extra_body=extra) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "thinking_delta") not in kinds, kinds
    assert ("content_block_delta", "signature_delta") in kinds, kinds
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    summarized: Any = {"type": kind, "display": "summarized"}
    shown = client.messages.create(model=model, max_tokens=50, messages=MSG,
                                   thinking=summarized, extra_body=extra)
    assert shown.content[0].thinking == REASONING  # type: ignore[union-attr]


def test_k2_p1_thinking_between_tools_is_served_as_thinking_off(r1: ScriptedServer) -> None:
    """K2, P1: ``{"type": "between_tools"}`` (the SDK's ThinkingConfigBetweenToolsParam:
    thinking off, only notes between tool calls as thinking blocks) is served as
    ``disabled``: no thinking block, the answer alone, whole and streamed (it was a 400
    naming ``thinking.type``); a key it does not take is a 400 naming it."""
    client, model = _claude(r1)
    thinking: Any = {"type": "between_tools"}
    msg = client.messages.create(model=model, max_tokens=50, messages=MSG, thinking=thinking)
    assert [b.type for b in msg.content] == ["text"], msg.content
    assert msg.content[0].text == ANSWER  # type: ignore[union-attr]
    with client.messages.stream(model=model, max_tokens=50, messages=MSG,
                                thinking=thinking) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    assert client.messages.count_tokens(model=model, messages=MSG,
                                        thinking=thinking).input_tokens > 0
    odd: Any = {"type": "between_tools", "display": "omitted"}
    message, _ = _refused(lambda: client.messages.create(
        model=model, max_tokens=50, messages=MSG, thinking=odd))
    assert message.startswith("thinking.display: Extra inputs"), message


def test_p1_thinking_display_and_keys_are_checked(smol: tuple[anthropic.Anthropic, str]
                                                   ) -> None:
    """P1: another ``display``, or a key the thinking type does not take, is a 400 naming it."""
    client, model = smol
    bad: Any = {"type": "adaptive", "display": "full"}
    message, _ = _refused(lambda: client.messages.create(
        model=model, max_tokens=4, messages=MSG, thinking=bad))
    assert message.startswith("thinking.display:") and "'omitted'" in message, message
    extra: Any = {"type": "disabled", "display": "omitted"}
    message, _ = _refused(lambda: client.messages.create(
        model=model, max_tokens=4, messages=MSG, thinking=extra))
    assert message.startswith("thinking.display: Extra inputs"), message


def test_p1_speed_geo_and_diagnostics_are_accepted(smol: tuple[anthropic.Anthropic, str]
                                                   ) -> None:
    """P1: the hints are served; ``usage.speed`` is ``"standard"`` when ``speed`` was sent
    (the message, ``message_start`` and ``message_delta``), absent when not."""
    client, model = smol
    kw: Any = {"speed": "fast", "inference_geo": "us",
               "diagnostics": {"previous_message_id": None}, "extra_body": {"temperature": 0}}
    msg = client.messages.create(model=model, max_tokens=4, messages=MSG, **kw)
    assert msg.usage.speed == "standard" and msg.diagnostics is None
    with client.messages.stream(model=model, max_tokens=4, messages=MSG, **kw) as stream:
        raw = [e for e in stream if e.type in ("message_start", "message_delta")]
        final = stream.get_final_message()
    start: Any = raw[0]
    assert start.message.usage.speed == "standard" and final.usage.speed == "standard"
    assert final.content[0].text == msg.content[0].text  # type: ignore[union-attr]
    plain = client.messages.create(model=model, max_tokens=4, messages=MSG, speed=None)
    assert plain.usage.speed is None
    odd: Any = {"previous_message_id": "msg_1", "x": 1}
    message, _ = _refused(lambda: client.messages.create(
        model=model, max_tokens=4, messages=MSG, diagnostics=odd))
    assert message.startswith("diagnostics.x: Extra inputs"), message


@pytest.mark.parametrize(("field", "value", "says"), [
    ("container", "container_1", "runs no containers"),
    ("context_management", {"edits": [{"type": "clear_tool_uses_20250919"}]},
     "does not edit the conversation"),
    ("mcp_servers", [{"type": "url", "url": "http://localhost:1", "name": "x"}],
     "connects to no MCP server"),
])
def test_p1_server_side_features_are_a_clear_400(smol: tuple[anthropic.Anthropic, str],
                                                 field: str, value: Any, says: str) -> None:
    """P1: each names itself and says what Coda cannot do (not "Extra inputs are not
    permitted", as a misspelled field); null asks for nothing and is served."""
    client, model = smol
    message, _ = _refused(lambda: client.messages.create(
        model=model, max_tokens=4, messages=MSG, extra_body={field: value}))
    assert message.startswith(f"{field}: ") and says in message, message
    ok = client.messages.create(model=model, max_tokens=4, messages=MSG,
                                extra_body={field: None})
    assert ok.stop_reason == "max_tokens"


def test_p1_error_body_carries_request_id(smol: tuple[anthropic.Anthropic, str]) -> None:
    """P1: a 400, a 404 (a model, a model card) and a malformed body each carry the
    ``request-id`` header's id in the body too, as Anthropic's errors do."""
    client, model = smol
    calls: list[Any] = [
        lambda: client.messages.create(model=model, max_tokens=4, messages=MSG,
                                       extra_body={"temperature": 5}),
        lambda: client.messages.create(model="nope", max_tokens=4, messages=MSG),
        lambda: client.models.retrieve("nope"),
        lambda: client.messages.count_tokens(model="nope", messages=MSG),
    ]
    for call in calls:
        with pytest.raises(anthropic.APIStatusError) as exc:
            call()
        body: Any = exc.value.body
        assert exc.value.request_id and body["request_id"] == exc.value.request_id, body
    raw = httpx.post(str(client.base_url).rstrip("/") + "/v1/messages", content=b"{bad",
                     headers={"content-type": "application/json"})
    assert raw.status_code == 400 and raw.json()["request_id"] == raw.headers["request-id"]


TOOLS: Any = [{"name": "f", "description": "a tool",
               "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}}}]


@pytest.mark.parametrize(("choice", "field", "says"), [
    ({"type": "auto", "disable_parallel_tool_use": "yes"},
     "tool_choice.disable_parallel_tool_use", "valid boolean"),
    ({"type": "auto", "foo": 1}, "tool_choice.foo", "Extra inputs"),
    ({"type": "none", "disable_parallel_tool_use": True},
     "tool_choice.disable_parallel_tool_use", "Extra inputs"),
])
def test_p1_tool_choice_keys_are_checked(smol: tuple[anthropic.Anthropic, str], choice: Any,
                                         field: str, says: str) -> None:
    """P1: a key the tool choice's type does not take, or a non-boolean
    ``disable_parallel_tool_use``, is a 400 naming it, on create and ``count_tokens`` (both
    were served: "yes" read as true)."""
    client, model = smol
    for call in (lambda: client.messages.create(model=model, max_tokens=4, messages=MSG,
                                                tools=TOOLS, tool_choice=choice),
                 lambda: client.messages.count_tokens(model=model, messages=MSG, tools=TOOLS,
                                                      tool_choice=choice)):
        message, _ = _refused(call)
        assert message.startswith(field + ":") and says in message, message
    ok: Any = {"type": "any", "disable_parallel_tool_use": True}
    msg = client.messages.create(model=model, max_tokens=40, messages=MSG, tools=TOOLS,
                                 tool_choice=ok)
    assert [b.type for b in msg.content] == ["tool_use"] and msg.stop_reason == "tool_use"
