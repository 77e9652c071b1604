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


def _refusal(url: str, path: str, body: dict[str, Any], shape: str) -> tuple[dict[str, Any], str]:
    """POST ``body``; assert a 400 in the protocol's error shape; its body and message."""
    r = httpx.post(url + path, content=json.dumps({"model": MODEL, **body}),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    if shape == "openai":
        assert err["error"]["type"] == "invalid_request_error", err
        return err, str(err["error"]["message"])
    if shape == "anthropic":
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        return err, str(err["error"]["message"])
    return err, str(err["error"])


@pytest.mark.parametrize(("path", "body", "shape"), CASES, ids=[c[0] for c in CASES])
def test_lone_surrogate_in_prompt_text_is_a_400_in_protocol_shape(
        server_live: Any, path: str, body: dict[str, Any], shape: str) -> None:
    err, message = _refusal(server_live.url, path, body, shape)
    assert "surrogate" in message, err


# NOTE: fields no tokenizer reads: echoed in the answer, stored, or quoted by an error. Each was
# a 500 (UnicodeEncodeError when the answer was encoded; a Responses one after it had run)
ECHOED = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "store": True, "metadata": {"k": BAD}}, "openai", "metadata.k"),
    ("/v1/chat/completions", {"model": BAD, "messages": [{"role": "user", "content": "hi"}]},
     "openai", "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "prediction": {"type": "content", "content": BAD}},
     "openai", "prediction.content"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "user": BAD}, "openai", "user"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "stream": True,
                       "safety_identifier": BAD}, "openai", "safety_identifier"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 16, "reasoning": {"summary": BAD}},
     "openai", "reasoning.summary"),
    ("/v1/messages", {"model": BAD, "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2}, "anthropic", "model"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False,
                   "keep_alive": BAD}, "ollama", "keep_alive"),
    ("/api/show", {"model": BAD}, "ollama", "model"),
]


@pytest.mark.parametrize(("path", "body", "shape", "where"), ECHOED,
                         ids=[f"{c[0]}:{c[3]}" for c in ECHOED])
def test_lone_surrogate_in_any_field_is_a_400_naming_its_path(
        server_live: Any, path: str, body: dict[str, Any], shape: str, where: str) -> None:
    """SPEC L5, P1: a lone surrogate in a field that is echoed, stored or quoted by an error
    (not only in prompt text) is a 400 naming its path in the protocol's shape, before the
    request runs; and nothing is stored, so the stored completions still list (a stored one
    made every later ``GET /v1/chat/completions`` a 500)."""
    err, message = _refusal(server_live.url, path, body, shape)
    if shape == "openai":
        assert err["error"]["param"] == where.split(".")[0], err
    assert message.startswith(f"{where}: ") and "surrogate" in message, err
    listed = httpx.get(server_live.url + "/v1/chat/completions", timeout=30)
    assert listed.status_code == 200, listed.text
