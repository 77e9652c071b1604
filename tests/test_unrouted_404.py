"""A path no route serves is a 404 that names the method and path (SPEC P1).

The official clients reach endpoints Coda does not serve (``client.batches``, ``files``,
``moderations``, ``images``, Anthropic's ``messages.batches``, ``beta.files``): each was a
bare 404 "Not Found", which cannot be told from a wrong base URL. It is now the protocol's 404
shape naming the request and where the served endpoints are listed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import openai
import pytest

_OPENAI: list[tuple[str, Callable[[openai.OpenAI], Any]]] = [
    ("GET /v1/batches", lambda c: c.batches.list()),
    ("GET /v1/files", lambda c: c.files.list()),
    ("POST /v1/moderations", lambda c: c.moderations.create(input="hi")),
]
_ANTHROPIC: list[tuple[str, Callable[[anthropic.Anthropic], Any]]] = [
    ("GET /v1/messages/batches", lambda c: c.messages.batches.list()),
    ("GET /v1/files", lambda c: c.beta.files.list()),
]


@pytest.mark.parametrize(("says", "call"), _OPENAI)
def test_p1_openai_unrouted_path_names_itself(server_live: Any, says: str,
                                              call: Callable[[openai.OpenAI], Any]) -> None:
    """P1: OpenAI's 404 shape; the message names the method and path."""
    client = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError) as exc:
        call(client)
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error", body
    assert body["message"].startswith(f"{says}: ") and "docs/api.md" in body["message"], body


@pytest.mark.parametrize(("says", "call"), _ANTHROPIC)
def test_p1_anthropic_unrouted_path_names_itself(server_live: Any, says: str,
                                                 call: Callable[[anthropic.Anthropic], Any]
                                                 ) -> None:
    """P1: Anthropic's ``not_found_error``; the message names the method and path."""
    client = anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as exc:
        call(client)
    body: Any = exc.value.body
    assert body["error"]["type"] == "not_found_error", body
    assert body["error"]["message"].startswith(f"{says}: "), body
