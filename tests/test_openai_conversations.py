"""OpenAI's Conversations API (``client.conversations``) on a server that offers none (SPEC P1).

``client.conversations.create()`` / ``.retrieve(id)`` / ``.items.list(id)`` were answered
404 "Not Found", the words of a mistyped path, so a client could not tell a missing feature
from a wrong base URL. The ``conversation`` field of a Responses create already says what to
do instead (coda.server.fields.UNOFFERED); every ``/v1/conversations`` path is now a 404 in
OpenAI's shape in those words.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
import pytest

_CALLS: list[Callable[[openai.OpenAI], Any]] = [
    lambda c: c.conversations.create(),
    lambda c: c.conversations.retrieve("conv_1"),
    lambda c: c.conversations.delete("conv_1"),
    lambda c: c.conversations.items.list("conv_1"),
]


@pytest.mark.parametrize("call", _CALLS)
def test_p1_conversations_api_is_a_404_saying_what_to_do(server_live: Any,
                                                         call: Callable[[openai.OpenAI], Any]
                                                         ) -> None:
    """P1: OpenAI's 404 shape, naming the Conversations API and ``previous_response_id``."""
    client = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.NotFoundError) as exc:
        call(client)
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error", body
    assert "Conversations API is not offered" in body["message"], body
    assert "previous_response_id" in body["message"], body
