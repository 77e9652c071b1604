"""Every OpenAI- and Anthropic-shaped answer carries its protocol's request id header
(SPEC P1), through the official clients over loopback: found by the sweep (a Responses
retrieve, cancel, delete and ``input_items`` carried no ``x-request-id``, so the SDK's
``_request_id`` was None; no 4xx carried one, so ``APIStatusError.request_id`` was None)."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.test_server_openai import MODEL

Q = [{"role": "user", "content": "hi"}]


def _rid(value: str | None) -> str:
    assert value is not None and value.startswith(("req_", "resp_")), value
    return value


def test_p1_responses_routes_on_a_stored_response_carry_x_request_id(
        oa: openai.OpenAI) -> None:
    """P1: retrieve, cancel, ``input_items`` and delete each answer with ``x-request-id``
    (the SDK's ``_request_id``), a fresh one per answer; the create keeps its response id."""
    # NOTE: background: only such a response can be cancelled (C1, as OpenAI)
    made = oa.responses.create(model=MODEL, input="hi", max_output_tokens=16, background=True)
    assert made._request_id == made.id
    got = oa.responses.with_raw_response.retrieve(made.id)
    cancelled = oa.responses.with_raw_response.cancel(made.id)
    items = oa.responses.input_items.with_raw_response.list(made.id)
    deleted = oa.responses.with_raw_response.delete(made.id)
    ids = [_rid(r.headers.get("x-request-id")) for r in (got, cancelled, items, deleted)]
    assert got.parse()._request_id == ids[0]
    assert len(set(ids)) == 4 and made.id not in ids, ids


def test_p1_responses_errors_carry_x_request_id(oa: openai.OpenAI) -> None:
    """P1: a 404 (unknown id on each stored-response route) and a 400 (a bad create) carry
    ``x-request-id``: the SDK's ``APIStatusError.request_id``."""
    calls: list[Any] = [lambda: oa.responses.retrieve("resp_nope"),
                        lambda: oa.responses.cancel("resp_nope"),
                        lambda: oa.responses.delete("resp_nope"),
                        lambda: oa.responses.input_items.list("resp_nope"),
                        lambda: oa.responses.create(model=MODEL, input="hi",
                                                    max_output_tokens=-1)]
    for call in calls:
        with pytest.raises(openai.APIStatusError) as info:
            call()
        assert 400 <= info.value.status_code < 500
        _rid(info.value.request_id)


def test_p1_chat_and_completions_errors_carry_x_request_id(oa: openai.OpenAI) -> None:
    """P1: a 4xx of chat and of completions, in OpenAI's shape, carries ``x-request-id``."""
    with pytest.raises(openai.BadRequestError) as chat:
        oa.chat.completions.create(model=MODEL, messages=Q,  # type: ignore[arg-type]
                                   max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError) as comp:
        oa.completions.create(model=MODEL, prompt="hi", max_tokens=2, top_p=7)
    with pytest.raises(openai.NotFoundError) as card:
        oa.models.retrieve("no-such-model")
    for err in (chat.value, comp.value, card.value):
        _rid(err.request_id)
        assert err.body is not None and "message" in err.body  # type: ignore[operator]


def test_p1_messages_errors_carry_request_id(an: anthropic.Anthropic) -> None:
    """P1: an Anthropic 4xx (in Anthropic's shape) carries ``request-id``, the SDK's
    ``request_id``, and a create still carries its message id there."""
    with pytest.raises(anthropic.BadRequestError) as info:
        an.messages.create(model=MODEL, max_tokens=2, messages=Q,  # type: ignore[arg-type]
                           extra_body={"top_k": -1})
    assert info.value.body["type"] == "error"  # type: ignore[index]
    _rid(info.value.request_id)
    raw = an.messages.with_raw_response.create(model=MODEL, max_tokens=2,
                                               messages=Q)  # type: ignore[arg-type]
    assert raw.headers.get("request-id") == raw.parse().id


def test_p1_auth_and_body_limit_refusals_carry_the_header(server_spawn: Any) -> None:
    """P1: a 401 of the key check and a 413 of the body limit (both before any route)
    carry the header of the protocol asked; Ollama's routes get none (its API sends none)."""
    live = server_spawn(api_key="secret")
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": Q})
    assert r.status_code == 401 and _rid(r.headers.get("x-request-id"))
    r = httpx.post(live.url + "/v1/messages", json={"messages": Q})
    assert r.status_code == 401 and _rid(r.headers.get("request-id"))
    assert "x-request-id" not in r.headers
    r = httpx.get(live.url + "/api/tags")
    assert r.status_code == 401 and "x-request-id" not in r.headers
    from coda.server.state import ServerSettings

    small = server_spawn(settings=ServerSettings(max_body_bytes=64))
    r = httpx.post(small.url + "/v1/responses", json={"input": "x" * 200})
    assert r.status_code == 413 and _rid(r.headers.get("x-request-id"))


class _Failing:
    """The session's engine, but ``stats`` (read by ``/health``) fails: a fault of the server
    itself, answered by Starlette outside every middleware."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def stats(self) -> Any:
        raise RuntimeError("boom")


def test_p1_a_500_carries_the_header_too(server_engine: Any) -> None:
    """P1: the 500 of an unexpected fault (an ``internal_error`` in the protocol's shape)
    carries ``x-request-id`` as every other answer does."""
    from coda.server.app import create_app
    from tests.conftest import LiveServer

    live = LiveServer(create_app(_Failing(server_engine), manage_engine=False)).start()
    try:
        r = httpx.get(live.url + "/health")
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error", r.text
        _rid(r.headers.get("x-request-id"))
    finally:
        live.stop()
