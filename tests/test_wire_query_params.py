"""A bad query parameter is a 400 naming the parameter as the wire spells it (``param:
"starting_after"``), like every other Responses error and like OpenAI — not FastAPI's
``query.starting_after``."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.test_server_openai import MODEL


@pytest.mark.parametrize(("query", "param"), [
    ({"stream": "true", "starting_after": "abc"}, "starting_after"),
    ({"stream": "true", "starting_after": "-5"}, "starting_after"),
    ({"stream": "maybe"}, "stream"),
])
def test_p3_responses_bad_query_names_the_bare_param(server_live: Any, query: dict[str, str],
                                                     param: str) -> None:
    """P3 resume cursor: ``GET /v1/responses/{id}?starting_after=abc`` → 400 in OpenAI's shape,
    ``param`` and the message's subject the parameter's own name."""
    made = httpx.post(server_live.url + "/v1/responses",
                      json={"model": MODEL, "input": "hi", "max_output_tokens": 16})
    r = httpx.get(f"{server_live.url}/v1/responses/{made.json()['id']}", params=query)
    err = r.json()["error"]
    assert r.status_code == 400 and err["type"] == "invalid_request_error", r.text
    assert err["param"] == param and err["message"].startswith(param), r.text


def test_body_field_errors_keep_their_dotted_path(server_live: Any) -> None:
    """Only the leading source tag goes: a nested body field is still ``input.0.role``."""
    r = httpx.post(server_live.url + "/v1/responses",
                   json={"model": MODEL, "input": [{"role": "bot", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.role", r.text
