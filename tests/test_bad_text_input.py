"""Bad text in a prompt is a 400 in the protocol's own error shape on every endpoint, never a
500 (brief "bad input"; SPEC S1 for stops, here every other text field)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

MODEL = "tiny-chat"
BAD = "hi \ud800 there"  # NOTE: json.dumps escapes it, so it travels as "\ud800" would

CASES = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}], "max_tokens": 2},
     "openai"),
    ("/v1/completions", {"prompt": BAD, "max_tokens": 2}, "openai"),
    ("/v1/responses", {"input": BAD, "max_output_tokens": 16}, "openai"),
    ("/v1/embeddings", {"input": BAD}, "openai"),
    ("/v1/messages", {"messages": [{"role": "user", "content": BAD}], "max_tokens": 2},
     "anthropic"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": BAD}]}, "anthropic"),
    ("/api/chat", {"messages": [{"role": "user", "content": BAD}], "stream": False}, "ollama"),
    ("/api/generate", {"prompt": BAD, "stream": False}, "ollama"),
    ("/api/embed", {"input": BAD}, "ollama"),
]


@pytest.mark.parametrize(("path", "body", "shape"), CASES, ids=[c[0] for c in CASES])
def test_lone_surrogate_in_prompt_text_is_a_400_in_protocol_shape(
        server_live: Any, path: str, body: dict[str, Any], shape: str) -> None:
    r = httpx.post(server_live.url + path, content=json.dumps({"model": MODEL, **body}),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    if shape == "openai":
        assert err["error"]["type"] == "invalid_request_error", err
        assert "surrogate" in err["error"]["message"]
    elif shape == "anthropic":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert "surrogate" in err["error"]["message"]
    else:
        assert "surrogate" in err["error"], err
