"""Anthropic Messages with tools, thinking off (SPEC K2, P1), through the official ``anthropic``
client: text the model wrote *after* a call stays after it. The whole message
(``messages.create``) and the message the stream accumulates (``messages.stream()``) hold the
same blocks in the order generated: text, ``tool_use``, text (the whole message once put all the
text first, the stream after the call).

The scripted output: ``Hi`` + one complete ``get_weather`` call + the start of a second call cut
by ``max_tokens`` (closure off, ``close_within_budget: false``): the cut call is returned as
text (nothing the model wrote is lost), after the first call's block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import pytest

from coda.engine.types import EngineConfig
from tests.wire_support import PositionRunner, scripted_anthropic, served_runner

MSG: list[Any] = [{"role": "user", "content": "weather?"}]
TOOLS: list[Any] = [{"name": "get_weather", "description": "weather of a city",
                     "input_schema": {"type": "object",
                                      "properties": {"city": {"type": "string"}}}}]
# NOTE: compact arguments, as the grammar writes them (no whitespace inside the JSON)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'
CUT = '\n<tool_call>\n{"name": "get'  # NOTE: a second call, cut by the budget
SCRIPT = "Hi " + CALL + CUT


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[anthropic.Anthropic,
                                                                         dict[str, Any]]]:
    """The default model scripted to write :data:`SCRIPT`; the request that ends at its end."""
    with contextmanager(served_runner)(
            PositionRunner, config=EngineConfig(num_blocks=64, max_num_seqs=2)) as served:
        engine = served.engine
        ids = engine.tokenizer.encode(SCRIPT, add_special_tokens=False).ids
        client = scripted_anthropic(served, MSG, TOOLS, ids)
        yield client, {"model": engine.model_name, "max_tokens": len(ids), "messages": MSG,
                       "tools": TOOLS, "extra_body": {"temperature": 0.0,
                                                      "close_within_budget": False}}


def _blocks(content: list[Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in content]


def test_k2_p1_text_after_a_call_keeps_its_place_streamed_or_not(
        scripted: tuple[anthropic.Anthropic, dict[str, Any]]) -> None:
    """K2, P1: text, ``tool_use``, text in both; the stream's blocks equal the whole
    message's (ids aside: each request has its own)."""
    client, kw = scripted
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in whole.content] == ["text", "tool_use", "text"]
    assert whole.content[0].text == "Hi "
    assert whole.content[1].input == {"city": "Paris"}
    assert whole.content[2].text == CUT.removeprefix("\n")  # NOTE: the newline is call syntax
    assert whole.stop_reason == final.stop_reason == "max_tokens"
    assert _blocks(final.content) == _blocks(whole.content)
    # NOTE: K2: no byte lost or added: the blocks' text plus the removed call syntax
    assert whole.model_extra is not None
    removed = whole.model_extra["coda"]["tool_calls"]["removed_bytes"]
    texts = "".join(b.text for b in whole.content if b.type == "text")
    assert len(texts.encode()) + removed == len(SCRIPT.encode())
