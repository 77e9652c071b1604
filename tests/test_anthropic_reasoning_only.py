"""Anthropic Messages over a reasoning model whose output is reasoning alone (SPEC P1, K2;
issue 23), through the official ``anthropic`` client: the streamed message that
``messages.stream()`` accumulates equals the whole message, block for block. With thinking
disabled (or tools on) the answer is an empty turn, ``content: []``, and the stream opens no
block; with the thinking block sent and no tools, both keep one empty text block after it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.reasoning_support import EOS, ME, OPEN_ID, THINK, reasoning_server
from tests.wire_support import ScriptedServer

MSG: list[Any] = [{"role": "user", "content": "hi"}]
TOOLS: list[Any] = [{"name": "get_weather", "description": "weather of a city",
                     "input_schema": {"type": "object",
                                      "properties": {"city": {"type": "string"}}}}]
# NOTE: " me think" then EOS inside the reasoning: no closing marker, no answer
REASONING_ONLY = {OPEN_ID: ME, ME: THINK, THINK: EOS}


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, REASONING_ONLY, inside=True)


def _both(server: ScriptedServer, **kw: Any) -> tuple[Any, Any, list[str]]:
    """The whole message, the stream's accumulated final message, and its event kinds."""
    client = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
    model = server.engine.model_name
    whole = client.messages.create(model=model, max_tokens=50, messages=MSG, **kw)
    with client.messages.stream(model=model, max_tokens=50, messages=MSG, **kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    return whole, final, kinds


@pytest.mark.parametrize("tools", [False, True], ids=["plain", "tools"])
def test_p1_thinking_disabled_reasoning_only_is_an_empty_turn(r1: ScriptedServer,
                                                              tools: bool) -> None:
    """P1: thinking disabled, the output all reasoning: ``content: []`` streamed or not (the
    stream opened an empty text block the whole message did not hold)."""
    whole, final, kinds = _both(r1, thinking={"type": "disabled"},
                                **({"tools": TOOLS} if tools else {}))
    assert whole.content == [] and whole.stop_reason == "end_turn"
    assert "content_block_start" not in kinds, kinds
    assert final.content == [] and final.stop_reason == "end_turn"


@pytest.mark.parametrize("tools", [False, True], ids=["plain", "tools"])
def test_k2_thinking_shown_reasoning_only_stream_equals_whole(r1: ScriptedServer,
                                                              tools: bool) -> None:
    """K2, P1: the thinking block sent: without tools one empty text block follows it, with
    tools none (only the blocks the answer holds), in the stream as in the whole message."""
    whole, final, _ = _both(r1, **({"tools": TOOLS} if tools else {}))
    types = ["thinking"] if tools else ["thinking", "text"]
    assert [b.type for b in whole.content] == types
    assert whole.content[0].thinking == " me think"
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
