"""The reason that ended a request (issue 14 item 4; SPEC L4, S1, S3, G1) through the official
``openai`` client."""

from __future__ import annotations

from typing import Any

import openai
import pytest

MODEL = "tiny-chat"


@pytest.fixture
def client(server_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)


def test_l4_no_max_tokens_stopped_by_the_context_is_context_limit(client: openai.OpenAI) -> None:
    """L4/G1: no max_tokens, a 500-token prompt in a 512-token context (default limit 32): the
    context ends it after 12 tokens, and the exact reason is context_limit."""
    r = client.completions.create(model=MODEL, prompt=[5] * 500,
                                  extra_body={"ignore_eos": True})
    ext = r.choices[0].model_extra["coda"]
    assert ext["finish_reason"] == "context_limit"
    assert r.choices[0].finish_reason == "length"
    assert ext["usage"]["selected_tokens"] == 12


def test_l4_explicit_max_tokens_at_the_context_is_max_output_tokens(
        client: openai.OpenAI) -> None:
    """L4/G1: an explicit max_tokens that equals the room left is the request's own limit:
    max_output_tokens (checked before the context in G1's order)."""
    r = client.completions.create(model=MODEL, prompt=[5] * 500, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].model_extra["coda"]["finish_reason"] == "max_output_tokens"


def test_s1_s3_include_stop_str_in_output_applies_to_stop_strings_not_stop_token_ids(
        client: openai.OpenAI, server_engine: Any) -> None:
    """S1/S3: a matched stop token-id sequence is never shown (like EOS), with or without
    ``include_stop_str_in_output``; that flag keeps matched stop *strings* only."""
    tid = 50
    text = server_engine.tokenizer.decode([tid], skip_special_tokens=False)
    force = {"logit_bias": {str(tid): 100}, "temperature": 0}
    for include in (False, True):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, **force,
                                      extra_body={"stop_token_ids": [[tid, tid]],
                                                  "include_stop_str_in_output": include})
        ext = r.choices[0].model_extra["coda"]
        assert r.choices[0].text == "" and ext["finish_reason"] == "stop_sequence"
        assert ext["usage"]["selected_tokens"] == 2 and ext["usage"]["returned_tokens"] == 0
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, stop=[text],
                                  **force, extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == text
    assert r.choices[0].model_extra["coda"]["finish_reason"] == "stop_sequence"
