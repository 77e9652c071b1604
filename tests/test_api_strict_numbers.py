"""A JSON ``true`` is never the integer 1 (the API-gaps issue item 2; SPEC P1): for every
integer (and number) field of every protocol's request body, found by walking the body's own
schema, a bool is a 400 in that protocol's error shape naming the field — never accepted as 1
(Python's ``bool`` is an ``int``). Plus one example through each official client."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from coda.server.embeddings import OpenAIEmbeddingRequest
from coda.server.ollama_schemas import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
)
from coda.server.protocol_schemas import AnthropicRequest, ResponsesRequest
from coda.server.schemas import ChatCompletionRequest, CompletionRequest
from tests.conftest import examples

MODEL = "tiny-chat"
MSG = [{"role": "user", "content": "hi"}]

# endpoint -> (body model, a valid base body, the protocol)
ENDPOINTS: dict[str, tuple[type[BaseModel], dict[str, Any], str]] = {
    "/v1/chat/completions": (ChatCompletionRequest,
                             {"model": MODEL, "messages": MSG, "max_tokens": 1}, "openai"),
    "/v1/completions": (CompletionRequest, {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                        "openai"),
    "/v1/responses": (ResponsesRequest, {"model": MODEL, "input": "hi",
                                         "max_output_tokens": 16}, "openai"),
    "/v1/embeddings": (OpenAIEmbeddingRequest, {"model": MODEL, "input": "hi"}, "openai"),
    "/v1/messages": (AnthropicRequest, {"model": MODEL, "messages": MSG, "max_tokens": 1},
                     "anthropic"),
    "/api/chat": (OllamaChatRequest, {"model": MODEL, "messages": MSG, "stream": False,
                                      "options": {"num_predict": 1}}, "ollama"),
    "/api/generate": (OllamaGenerateRequest, {"model": MODEL, "prompt": "hi", "stream": False,
                                              "options": {"num_predict": 1}}, "ollama"),
    "/api/embed": (OllamaEmbedRequest, {"model": MODEL, "input": "hi"}, "ollama"),
}


def _kinds(node: dict[str, Any], defs: dict[str, Any]) -> list[dict[str, Any]]:
    """The alternatives of a schema node (``anyOf`` flattened, ``$ref`` resolved)."""
    if "$ref" in node:
        return _kinds(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in node:
        return [k for alt in node["anyOf"] for k in _kinds(alt, defs)]
    return [node]


def numeric_fields(model: type[BaseModel]) -> list[tuple[str, ...]]:
    """Every path (through nested objects) to a field that takes an integer or a number,
    or a list of integers (the bool goes in as the list's element)."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    out: list[tuple[str, ...]] = []

    def walk(node: dict[str, Any], prefix: tuple[str, ...]) -> None:
        for name, prop in node.get("properties", {}).items():
            path = (*prefix, name)
            kinds = _kinds(prop, defs)
            types = {k.get("type") for k in kinds}
            if types & {"integer", "number"}:
                out.append(path)
            elif any(k.get("type") == "array" and "integer" in {
                    i.get("type") for i in _kinds(k.get("items", {}), defs)} for k in kinds):
                out.append((*path, "[]"))
            for k in kinds:
                if k.get("type") == "object" and "properties" in k:
                    walk(k, path)

    walk(schema, ())
    return out


CASES = [(endpoint, path) for endpoint, (model, _, _) in ENDPOINTS.items()
         for path in numeric_fields(model)]


def _with(body: dict[str, Any], path: tuple[str, ...], value: bool) -> dict[str, Any]:
    """``body`` with the field at ``path`` set to ``value`` (``[value]`` for a list field)."""
    out = dict(body)
    node = out
    keys = [p for p in path if p != "[]"]
    for key in keys[:-1]:
        node[key] = dict(node.get(key) or {})
        node = node[key]
    node[keys[-1]] = [value] if path[-1] == "[]" else value
    return out


def _name(path: tuple[str, ...]) -> str:
    return ".".join(p for p in path if p != "[]")


def test_the_walk_finds_the_integer_fields_users_set() -> None:
    """The oracle's own check: the schema walk covers the fields the issue names."""
    found = {(e, _name(p)) for e, p in CASES}
    for want in [("/v1/chat/completions", "max_tokens"), ("/v1/chat/completions", "n"),
                 ("/v1/chat/completions", "top_logprobs"), ("/v1/chat/completions", "seed"),
                 ("/v1/chat/completions", "max_completion_tokens"),
                 ("/v1/chat/completions", "backpressure.pause_bytes"),
                 ("/v1/chat/completions", "stop_token_ids"),
                 ("/v1/completions", "logprobs"), ("/v1/completions", "prompt"),
                 ("/v1/responses", "max_output_tokens"), ("/v1/messages", "max_tokens"),
                 ("/v1/messages", "top_k"), ("/api/chat", "options.num_predict"),
                 ("/api/generate", "options.seed"), ("/api/embed", "dimensions"),
                 ("/v1/embeddings", "dimensions")]:
        assert want in found, want


@settings(deadline=None, max_examples=examples(60),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=st.sampled_from(CASES), value=st.booleans())
def test_p1_a_bool_in_any_numeric_field_is_a_400_naming_it(server_live: Any,
                                                           case: tuple[str, tuple[str, ...]],
                                                           value: bool) -> None:
    """P1, for all (endpoint, numeric field, bool): the answer is a 400 in the endpoint's
    protocol shape whose message names the field (OpenAI: also ``param``)."""
    endpoint, path = case
    _, base, protocol = ENDPOINTS[endpoint]
    resp = httpx.post(server_live.url + endpoint, json=_with(base, path, value), timeout=60)
    assert resp.status_code == 400, (endpoint, path, resp.text[:200])
    body, name = resp.json(), _name(path)
    if protocol == "openai":
        assert body["error"]["type"] == "invalid_request_error"
        # NOTE: a list's element is named by its index (``stop_token_ids.0``)
        assert body["error"]["param"] in (name, name + ".0")
        assert name in body["error"]["message"]
    elif protocol == "anthropic":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert name in body["error"]["message"]
    else:
        assert list(body) == ["error"] and name in body["error"]


def test_p1_official_clients_sending_true_get_their_400(server_live: Any) -> None:
    """P1: ``max_tokens=True`` through the openai and anthropic clients, ``num_predict: True``
    through the ollama client: each raises its client's 400 naming the field."""
    oa = openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=MODEL, messages=MSG,  # type: ignore[arg-type]
                                   max_tokens=True)
    assert exc.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=MODEL, messages=MSG, n=True)  # type: ignore[arg-type]
    assert exc.value.body["param"] == "n"  # type: ignore[index]
    an = anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as aexc:
        an.messages.create(model=MODEL, messages=MSG, max_tokens=True)  # type: ignore[arg-type]
    assert "max_tokens" in str(aexc.value)
    ol = ollama.Client(host=server_live.url)
    with pytest.raises(ollama.ResponseError) as oexc:
        ol.chat(model=MODEL, messages=MSG, options={"num_predict": True})
    assert oexc.value.status_code == 400 and "options.num_predict" in oexc.value.error
