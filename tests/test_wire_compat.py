"""What the upstream APIs accept is accepted by Coda and means what it means there (SPEC P1,
L4). Found by the third black-box acceptance sweep (sweep3), through the official clients on
SmolLM2 Q4_1 and Gemma 3 270M:

- Ollama ``options.num_predict: -1`` / ``-2`` ("no limit but the context's", docs/api.md)
  ended at ``EngineConfig.default_max_tokens`` (256 tokens, ``length``), as if unset.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import ollama
import pytest

MODEL = "tiny-chat"
CONTEXT = 512  # NOTE: the server fixture's context (tests/conftest.py: server_checkpoint)
DEFAULT_MAX = 32  # NOTE: its EngineConfig.default_max_tokens


class _IgnoreEos(httpx.HTTPTransport):
    """Adds Coda's ``ignore_eos`` extension to the official Ollama client's body (it has no
    such argument), so only a budget can end the output."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        content = json.dumps({**json.loads(request.content), "ignore_eos": True}).encode()
        request = httpx.Request(request.method, request.url, content=content,
                                headers={**request.headers, "content-length": str(len(content))})
        return super().handle_request(request)


@pytest.mark.parametrize("num_predict", [-1, -2])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_l4_ollama_num_predict_unlimited_runs_to_the_context(
        server_live: Any, num_predict: int, chat: bool) -> None:
    """SPEC L4: ``num_predict`` -1 / -2 asks for no limit but the context's: with EOS ignored
    the output fills the context (prompt + output == the context), ``done_reason`` ``length``;
    it stopped at the server's default budget, the reading of an unset ``num_predict``."""
    c = ollama.Client(host=server_live.url, transport=_IgnoreEos())
    options = {"num_predict": num_predict, "temperature": 0}
    r: Any = (c.chat(model=MODEL, messages=[{"role": "user", "content": "q"}], options=options)
              if chat else c.generate(model=MODEL, prompt="q", options=options))
    assert r.done_reason == "length" and r.eval_count > DEFAULT_MAX, r
    # NOTE: the client drops ``coda``; the raw answer says how many prompt tokens there were
    body = ({"messages": [{"role": "user", "content": "q"}]} if chat else {"prompt": "q"}) | {
        "model": MODEL, "stream": False, "options": options, "ignore_eos": True}
    raw = httpx.post(server_live.url + ("/api/chat" if chat else "/api/generate"), json=body,
                     timeout=120).json()
    assert raw["coda"]["usage"]["prompt_tokens"] + raw["eval_count"] == CONTEXT, raw["coda"]


def test_l4_ollama_num_predict_unset_is_still_the_default(server_live: Any) -> None:
    """SPEC L4: an unset ``num_predict`` keeps the server's default budget (docs/api.md)."""
    r = ollama.Client(host=server_live.url, transport=_IgnoreEos()).generate(
        model=MODEL, prompt="q", options={"temperature": 0})
    assert r.done_reason == "length" and r.eval_count == DEFAULT_MAX, r
