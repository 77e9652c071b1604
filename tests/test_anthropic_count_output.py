"""``POST /v1/messages/count_tokens`` reads ``output_config`` as ``POST /v1/messages`` does
(SPEC P1: the count takes the create's 400s, never a count of a request create refuses).

``output_config`` (and the older ``output_format``) are checked as the create checks them: an
unknown key, an effort Anthropic has not, a format that is no JSON schema, a schema the
grammar engine refuses, a format beside active tools — each the create's 400 with the same
message and field; a valid format counts as the prompt without it (the format constrains the
output, it adds nothing to the prompt). Before, count_tokens ignored them: a 200 count for
every one of those requests.
"""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.test_server_openai import MODEL

_MSGS = [{"role": "user", "content": "hi"}]
_TOOL = {"name": "get", "description": "d", "input_schema": {"type": "object"}}
_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
_BAD: list[dict[str, Any]] = [
    {"output_config": {"format": {"type": "json_schema", "schema": _SCHEMA}, "x": 1}},
    {"output_config": {"effort": "huge"}},
    {"output_config": {"format": {"type": "json_schema"}}},
    {"output_config": {"format": {"type": "json_schema",
                                  "schema": {"type": "object", "minProperties": "x"}}}},
    {"output_config": {"format": {"type": "json_schema", "schema": _SCHEMA}},
     "tools": [_TOOL]},
    {"output_format": {"type": "json_schema", "schema": _SCHEMA},
     "output_config": {"format": {"type": "json_schema", "schema": _SCHEMA}}},
]


def _error(call: Any) -> dict[str, Any]:
    with pytest.raises(anthropic.BadRequestError) as e:
        call()
    body: Any = e.value.body
    return dict(body["error"])


@pytest.mark.parametrize("fields", _BAD)
def test_p1_count_tokens_takes_the_creates_output_config_400(server_live: Any,
                                                              fields: dict[str, Any]) -> None:
    """P1: each bad ``output_config`` → the same 400 (message) on count_tokens as on create
    (official client, ``extra_body`` for what its types do not take)."""
    client = anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)
    created = _error(lambda: client.messages.create(
        model=MODEL, max_tokens=4, messages=_MSGS, extra_body=fields))  # type: ignore[arg-type]
    counted = _error(lambda: client.messages.count_tokens(
        model=MODEL, messages=_MSGS, extra_body=fields))  # type: ignore[arg-type]
    if "minProperties" in str(fields):
        # NOTE: the grammar engine's refusal: create meets it at submit, and the test model's
        # tokenizer may be refused there first (its own 400 on the same field)
        assert created["message"].startswith("output_config.format: "), created
        assert counted["message"].startswith("output_config.format: invalid grammar: "), counted
        assert "minProperties" in counted["message"], counted
    else:
        assert counted == created


def test_p1_count_tokens_with_a_valid_output_config_counts_the_prompt(server_live: Any
                                                                        ) -> None:
    """P1: a valid format (and effort) is accepted and counts what the prompt alone counts."""
    client = anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)
    plain = client.messages.count_tokens(model=MODEL, messages=_MSGS)  # type: ignore[arg-type]
    shaped = client.messages.count_tokens(
        model=MODEL, messages=_MSGS,  # type: ignore[arg-type]
        output_config={"format": {"type": "json_schema", "schema": _SCHEMA}, "effort": "low"})
    assert shaped.input_tokens == plain.input_tokens
