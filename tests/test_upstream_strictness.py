"""Inputs the upstream APIs refuse with a 400 are refused by Coda too, in the protocol's own
error shape and naming the protocol's own field (SPEC P1: the request is refused before it
starts; "bad input is a 4xx naming the field"). Found by the black-box acceptance sweep
(strict37), where each of these bodies was answered (or its 400 named another protocol's
field):

- Ollama ``format`` that does not compile: the 400 named ``response_format`` (OpenAI's field);
- OpenAI ``seed`` outside the signed 64-bit range: answered (the RNG takes it mod 2**64);
- Responses ``include`` with a value OpenAI does not document: answered;
- Anthropic ``thinking: {"type": "enabled"}`` without ``budget_tokens``: answered;
- Anthropic ``top_k: -1`` (Anthropic's top_k is >= 0; -1 is "off" elsewhere): answered.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

MODEL = "tiny-chat"
Q = {"role": "user", "content": "q"}


def _post(live: Any, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(live.url + path, json={"model": MODEL, **body}, timeout=60)


def _openai_400(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == field, err
    assert err["message"].startswith(field + ":"), err


def _anthropic_400(r: httpx.Response, field: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["message"].startswith(field + ":"), err


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
@pytest.mark.parametrize("fmt", [{"type": "bogus"}, "json"], ids=["schema", "json"])
def test_p1_ollama_format_that_does_not_compile_names_format(
        server_live: Any, path: str, fmt: Any) -> None:
    """SPEC P1: a ``format`` the grammar engine refuses is a 400 naming ``format``, Ollama's
    field; it named ``response_format``. (The tiny test tokenizer has no grammar support, so
    every grammar is refused here: what counts is the field the refusal names.)"""
    body = ({"messages": [Q]} if path == "/api/chat" else {"prompt": "q"}) | {
        "stream": False, "format": fmt, "options": {"num_predict": 2}}
    r = _post(server_live, path, body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert message.startswith("format:") and "response_format" not in message, message


def test_p1_ollama_response_format_extension_still_names_itself(server_live: Any) -> None:
    """SPEC P1: Coda's ``response_format`` extension on an Ollama route, with no ``format``,
    keeps its own name in the refusal (only a grammar from ``format`` is renamed)."""
    r = _post(server_live, "/api/chat", {"messages": [Q], "stream": False,
                                         "response_format": {"type": "json_object"}})
    assert r.status_code == 400, r.text
    assert r.json()["error"].startswith("response_format:"), r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("seed", [2 ** 63, -(2 ** 63) - 1, 2 ** 64], ids=["2^63", "-2^63-1", "2^64"])
def test_p1_openai_seed_outside_int64_is_a_400(server_live: Any, path: str, seed: int) -> None:
    """SPEC P1: OpenAI's ``seed`` is a signed 64-bit integer; past it was answered."""
    prompt = {"messages": [Q]} if path == "/v1/chat/completions" else {"prompt": "q"}
    _openai_400(_post(server_live, path, {**prompt, "max_tokens": 2, "seed": seed}), "seed")


@pytest.mark.parametrize("seed", [2 ** 63 - 1, -(2 ** 63), -5, 0])
def test_t4_openai_seed_within_int64_is_still_served_and_reproducible(
        server_live: Any, seed: int) -> None:
    """SPEC T4: every seed within int64 (the bounds and negative ones included) is served as
    before, and the same seed draws the same tokens (n=2: choice 1 uses ``seed + 1``, which
    may step past the bound; the RNG takes it mod 2**64)."""
    body = {"messages": [Q], "max_tokens": 4, "seed": seed, "n": 2}
    a, b = (_post(server_live, "/v1/chat/completions", body) for _ in range(2))
    assert a.status_code == b.status_code == 200, a.text
    texts = [[c["message"]["content"] for c in r.json()["choices"]] for r in (a, b)]
    assert texts[0] == texts[1], texts


def test_p1_responses_include_unknown_value_is_a_400(server_live: Any) -> None:
    """SPEC P1: ``include`` takes the values OpenAI documents; another was answered."""
    r = _post(server_live, "/v1/responses",
              {"input": "q", "max_output_tokens": 16, "include": ["bogus"]})
    _openai_400(r, "include.0")


DOCUMENTED = ["file_search_call.results", "web_search_call.results",
              "web_search_call.action.sources", "message.input_image.image_url",
              "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              "reasoning.encrypted_content", "message.output_text.logprobs"]


def test_p1_responses_include_documented_values_are_accepted(server_live: Any) -> None:
    """SPEC P1: every documented ``include`` value is accepted, and the one Coda honours
    (``message.output_text.logprobs``) still puts logprobs on the output text."""
    r = _post(server_live, "/v1/responses",
              {"input": "q", "max_output_tokens": 16, "include": DOCUMENTED})
    assert r.status_code == 200, r.text
    part = r.json()["output"][0]["content"][0]
    assert part["type"] == "output_text" and len(part["logprobs"]) >= 1, part
    plain = _post(server_live, "/v1/responses", {"input": "q", "max_output_tokens": 16,
                                                 "include": ["reasoning.encrypted_content"]})
    assert plain.status_code == 200, plain.text
    assert not plain.json()["output"][0]["content"][0].get("logprobs"), plain.text


def test_p1_anthropic_thinking_enabled_without_budget_is_a_400(server_live: Any) -> None:
    """SPEC P1: Anthropic requires ``thinking.budget_tokens`` with ``type: enabled``; it was
    answered with no budget. ``disabled`` (no budget) is answered as before, and a budget
    given (as ``budget_tokens`` or Coda's ``max_reasoning_tokens``) passes this check (the
    tiny model has no reasoning markers, so it then meets that check's 400 instead)."""
    base = {"messages": [Q], "max_tokens": 2}
    for thinking in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": None}):
        _anthropic_400(_post(server_live, "/v1/messages", {**base, "thinking": thinking}),
                       "thinking.budget_tokens")
    r = _post(server_live, "/v1/messages", {**base, "thinking": {"type": "disabled"}})
    assert r.status_code == 200, r.text
    # NOTE: a budget_tokens must be >= 1024 and < max_tokens (tests/test_anthropic_thinking)
    for extra in ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 1025},
                  {"thinking": {"type": "enabled"}, "max_reasoning_tokens": 8}):
        r = _post(server_live, "/v1/messages", {**base, **extra})
        assert r.status_code == 400 and "no reasoning markers" in r.text, r.text
    r = _post(server_live, "/v1/messages",
              {**base, "thinking": {"type": "enabled", "budget_tokens": "x"}})
    _anthropic_400(r, "thinking.budget_tokens")


def test_p1_anthropic_negative_top_k_is_a_400(server_live: Any) -> None:
    """SPEC P1: Anthropic's ``top_k`` is >= 0; ``-1`` (off in vLLM / SamplingParams) was
    answered. ``0`` is still off and ``1`` still greedy."""
    base = {"messages": [Q], "max_tokens": 2}
    _anthropic_400(_post(server_live, "/v1/messages", {**base, "top_k": -1}), "top_k")
    for k in (0, 1):
        r = _post(server_live, "/v1/messages", {**base, "top_k": k})
        assert r.status_code == 200, r.text
    # NOTE: other protocols keep their own -1 ("off"): only Anthropic's schema narrows it
    r = _post(server_live, "/v1/chat/completions", {**base, "top_k": -1})
    assert r.status_code == 200, r.text


def test_p1_responses_text_format_that_does_not_compile_names_text_format(
        server_live: Any) -> None:
    """SPEC P1: as Ollama's ``format``: a Responses ``text.format`` the grammar engine refuses
    is a 400 naming ``text.format``; it named ``response_format`` (chat's field)."""
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}
    r = _post(server_live, "/v1/responses",
              {"input": "q", "max_output_tokens": 16, "text": {"format": fmt}})
    _openai_400(r, "text.format")
    assert "response_format" not in r.text, r.text


def test_p1_count_tokens_checks_thinking_as_messages_does(server_live: Any) -> None:
    """SPEC P1: ``/v1/messages/count_tokens`` takes ``thinking`` too; a bad one was counted
    (200). Now the same 400s as ``/v1/messages``; a good one is still counted."""
    base = {"messages": [Q]}
    for thinking, field in (({"type": "enabled"}, "thinking.budget_tokens"),
                            ({"type": "enabled", "budget_tokens": -1}, "thinking.budget_tokens"),
                            ({"type": "on"}, "thinking.type")):
        _anthropic_400(_post(server_live, "/v1/messages/count_tokens",
                             {**base, "thinking": thinking}), field)
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024}):
        r = _post(server_live, "/v1/messages/count_tokens", {**base, "thinking": thinking})
        assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


@pytest.mark.parametrize("seed", [2 ** 63, -(2 ** 63) - 1])
def test_p1_seed_outside_int64_is_a_400_on_every_protocol(server_live: Any, seed: int) -> None:
    """SPEC P1: one bound for ``seed`` on every route (Ollama's ``options.seed`` is an int64
    as OpenAI's; Anthropic's and Responses' are Coda's extension, with the same rule), each
    refused in its protocol's shape; the bound itself is still served."""
    r = _post(server_live, "/v1/messages", {"messages": [Q], "max_tokens": 2, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "seed" in r.json()["error"]["message"], r.text
    r = _post(server_live, "/v1/responses", {"input": "q", "max_output_tokens": 16, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    for path in ("/api/chat", "/api/generate"):
        body = {"stream": False, "options": {"num_predict": 2, "seed": seed},
                **({"messages": [Q]} if path == "/api/chat" else {"prompt": "q"})}
        r = _post(server_live, path, body)
        assert r.status_code == 400 and "seed" in r.json()["error"], (path, r.text)
    edge = 2 ** 63 - 1 if seed > 0 else -(2 ** 63)
    assert _post(server_live, "/v1/messages",
                 {"messages": [Q], "max_tokens": 2, "seed": edge}).status_code == 200
    r = _post(server_live, "/api/generate", {"prompt": "q", "stream": False,
                                            "options": {"num_predict": 2, "seed": edge}})
    assert r.status_code == 200, r.text


A = {"role": "assistant"}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(("messages", "field"), [
    ([{"role": "user", "content": ""}], "messages.0"),
    ([{"role": "user", "content": []}], "messages.0"),
    ([Q, {**A, "content": "a"}, {"role": "user", "content": ""}], "messages.2"),
    ([{"role": "user", "content": [{"type": "text", "text": ""}]}], "messages.0.content.0"),
    ([Q, {**A, "content": "The sea "}], "messages.1"),
    ([Q, {**A, "content": "The sea\n"}], "messages.1"),
    ([Q, {**A, "content": [{"type": "text", "text": "The sea "}]}], "messages.1"),
], ids=["empty-str", "empty-list", "empty-later", "empty-block", "prefill-space",
        "prefill-newline", "prefill-block-space"])
def test_p1_anthropic_empty_content_and_prefill_whitespace_are_400s(
        server_live: Any, path: str, messages: list[dict[str, Any]], field: str) -> None:
    """SPEC P1: Anthropic refuses an empty message (but an empty final assistant one), an
    empty text block and a prefill ending in whitespace, on ``count_tokens`` too; each was
    answered (sweep3)."""
    body: dict[str, Any] = {"messages": messages}
    if path == "/v1/messages":
        body["max_tokens"] = 2
    _anthropic_400(_post(server_live, path, body), field)


@pytest.mark.parametrize("messages", [
    [Q, {**A, "content": ""}], [Q, {**A, "content": "The sea"}],
    [Q, {**A, "content": [{"type": "text", "text": "The sea"}]}],
    [{"role": "user", "content": "  q  "}]], ids=["empty-prefill", "prefill", "prefill-block",
                                                  "user-spaces"])
def test_p1_anthropic_prefills_and_user_whitespace_still_served(
        server_live: Any, messages: list[dict[str, Any]]) -> None:
    """SPEC P1: an empty final assistant message, a prefill without trailing whitespace and
    a user message with spaces around it are served as before."""
    r = _post(server_live, "/v1/messages", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_p1_anthropic_metadata_takes_user_id_only(server_live: Any) -> None:
    """SPEC P1: ``metadata`` has one field, ``user_id``; another is a 400 naming it, as
    Anthropic answers (it was accepted)."""
    r = _post(server_live, "/v1/messages", {"messages": [Q], "max_tokens": 2,
                                           "metadata": {"user_id": "u1"}})
    assert r.status_code == 200, r.text
    r = _post(server_live, "/v1/messages", {"messages": [Q], "max_tokens": 2,
                                           "metadata": {"foo": "u1"}})
    assert r.status_code == 400 and "metadata.foo" in r.json()["error"]["message"], r.text
