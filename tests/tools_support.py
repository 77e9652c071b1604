"""Shared parts of the tool-calling wire tests (issue 20): schemas, prompts, a live server on
the embedded default model with the official clients, and a streamed-chat accumulator."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai

from tests.conftest import LiveServer

TIME = {"type": "object", "required": ["zone"], "additionalProperties": False,
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
# NOTE: a schema-valid value holding the close tag, the open tag, quotes, a backslash, braces
NASTY = 'a</tool_call>b "q" \\ <tool_call> {x} é'
NOTE = {"type": "object", "required": ["text"], "additionalProperties": False,
        "properties": {"text": {"enum": [NASTY]}}}
OA_TOOLS: Any = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}},
                 {"type": "function", "function": {"name": "note", "parameters": NOTE}}]
AN_TOOLS: Any = [{"name": "get_time", "input_schema": TIME},
                 {"name": "note", "input_schema": NOTE}]
RS_TOOLS: Any = [{"type": "function", "name": "get_time", "parameters": TIME},
                 {"type": "function", "name": "note", "parameters": NOTE}]
# NOTE: Ollama's tool shape (OpenAI's function tool), a one-argument weather lookup
OLLAMA_WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
STORY: Any = [{"role": "user", "content": "Tell me a long story about a cat."}]
ASK: Any = [{"role": "user", "content": "What time is it?"}]
# NOTE: ignore_eos: the answer is certainly cut by the budget (issue 20 D1)
TEXT_CUT: Any = {"seed": 1, "ignore_eos": True}


@dataclass(frozen=True)
class Wire:
    """A live server and the official clients pointed at it."""

    live: LiveServer
    oa: openai.OpenAI
    an: anthropic.Anthropic
    model: str


def serve() -> Iterator[Wire]:
    """A live server on the embedded default model (the body of a module fixture)."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=8))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    oa = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    try:
        yield Wire(server, oa, anthropic.Anthropic(base_url=server.url, api_key="x",
                                                   max_retries=0), oa.models.list().data[0].id)
    finally:
        server.stop()
        engine.shutdown()


def chat_stream(oa: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A streamed chat call, accumulated: content, calls, finish reason, coda, stamps."""
    out: dict[str, Any] = {"content": "", "calls": {}, "reason": None, "coda": None,
                           "stamps": [], "chunks": 0}
    for chunk in oa.chat.completions.create(stream=True, **kwargs):
        extra = chunk.model_extra or {}
        for ch in chunk.choices:
            out["reason"] = ch.finish_reason or out["reason"]
            out["content"] += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                cur = out["calls"].setdefault(d.index, {"name": "", "arguments": ""})
                assert d.function is not None
                cur["name"] += d.function.name or ""
                cur["arguments"] += d.function.arguments or ""
            if ch.delta.content or ch.delta.tool_calls:
                out["chunks"] += 1
        coda = extra.get("coda")
        if coda and "digest" in coda:
            out["stamps"].append(coda)
        if coda and "finish_reason" in coda:
            out["coda"] = coda
    return out


def feed_in_pieces(parser: Any, whole: str, cuts: list[int]) -> list[Any]:
    """Feed ``whole`` to a ToolCallParser as deltas cut at ``cuts``, then finish: its items."""
    items: list[Any] = []
    prev = 0
    for c in sorted(cuts) + [len(whole)]:
        c = min(c, len(whole))
        items += parser.feed(whole[prev:c])
        prev = max(prev, c)
    return items + parser.finish()
