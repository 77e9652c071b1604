"""Anthropic Messages over a reasoning model (SPEC P1, K2; issue 23), through the official
``anthropic`` client: the streamed message that ``messages.stream()`` accumulates equals the
whole message, block for block. An output of reasoning alone: with thinking disabled the
answer is an empty turn, ``content: []``, and the stream opens no block; with the thinking
block sent, one empty text block follows it without tools and none with tools. A tool call
after the reasoning streams as a ``tool_use`` block, as without reasoning."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anthropic
import pytest

from coda.engine.types import EngineConfig
from tests.reasoning_support import (
    CLOSE_ID,
    EOS,
    ME,
    OPEN_ID,
    THINK,
    reasoning_model_dir,
    reasoning_server,
)
from tests.wire_support import PositionRunner, ScriptedServer, scripted_anthropic, served_runner

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
        kinds: list[str] = [e.type for e in stream]
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


@pytest.fixture(scope="module")
def caller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[anthropic.Anthropic, str]]:
    """The r1 reasoning model scripted to write " me" ``</think>`` then one ``get_weather``
    call (greedy: a token the call's grammar refuses is replaced the same way every time)."""
    root: Path = tmp_path_factory.mktemp("caller")
    with contextmanager(served_runner)(
            PositionRunner, model_dir=reasoning_model_dir(root, inside=True),
            config=EngineConfig(num_blocks=64, max_num_seqs=2)) as served:
        engine = served.engine
        call = engine.tokenizer.encode('<tool_call>\n{"name": "get_weather", "arguments": '
                                       '{"city": "Paris"}}\n</tool_call>',
                                       add_special_tokens=False).ids
        client = scripted_anthropic(served, MSG, TOOLS, [ME, CLOSE_ID, *call])
        yield client, engine.model_name


def test_k2_a_tool_call_after_thinking_streams_as_tool_use(
        caller: tuple[anthropic.Anthropic, str]) -> None:
    """K2, P1: with tools, the answer after the thinking block goes through the tool-call
    parser streamed too (it streamed the call's markup as text): thinking then ``tool_use``,
    equal to the whole message's blocks (ids aside: each request has its own)."""
    client, model = caller
    kw: Any = {"model": model, "max_tokens": 80, "messages": MSG, "tools": TOOLS,
               "extra_body": {"temperature": 0.0}}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking", "tool_use"]
    assert whole.stop_reason == final.stop_reason == "tool_use"

    def blocks(content: list[Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in content]

    assert blocks(final.content) == blocks(whole.content)
    assert whole.content[1].input == {"city": "Paris"}
