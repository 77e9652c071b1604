"""A FAILED request looks failed in every protocol's own idiom, through the official clients,
while ``coda`` keeps the loop's exact reason (issue 8 defect 4; SPEC L4, L5, K3).

The scripted default model answers ``x``, a lone ``0xC3`` and EOS: the request ends FAILED
(``decoding_error``) with the loop's reason ``eos`` and the partial text ``x``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.wire_support import ScriptedServer, scripted_server

MODEL = "default_model"
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ScriptedServer]:
    yield from scripted_server()


def oai(server: ScriptedServer, retries: int = 2) -> openai.OpenAI:
    # NOTE: the SDK default of 2 retries: a 5xx without x-should-retry: false is sent 3 times
    return openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=retries)


def claude(server: ScriptedServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=2)


def assert_failed_outcome(coda: dict[str, Any]) -> None:
    """K3 + L4: the state says FAILED, the reason stays the loop's, the error is typed."""
    assert coda["state"] == "FAILED"
    assert coda["finish_reason"] == "eos"
    assert coda["error"]["code"] == "decoding_error"
    assert coda["usage"]["returned_bytes"] == 1  # the partial text "x" stands


def sse_data(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MSG}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_l4_k3_openai_stream_error_frame_before_done(server: ScriptedServer, path: str,
                                                     body: dict[str, Any]) -> None:
    """Chat and completions streams: an ``{"error": …}`` data frame, then ``[DONE]``; the
    openai SDK raises APIError on it after yielding the partial text."""
    r = httpx.post(server.url + path, json={"model": MODEL, "stream": True, "max_tokens": 8,
                                            **body}, timeout=30)
    data = sse_data(r.text)
    assert data[-1] == "[DONE]"
    last = json.loads(data[-2])
    assert last["error"]["code"] == "decoding_error" and last["error"]["type"] == "server_error"
    assert_failed_outcome(last["coda"])
    assert not any('"finish_reason":"stop"' in d for d in data)
    client = oai(server)
    seen = ""
    with pytest.raises(openai.APIError) as err:
        if path.endswith("chat/completions"):
            for chunk in client.chat.completions.create(model=MODEL, messages=MSG, stream=True,
                                                        max_tokens=8):
                seen += chunk.choices[0].delta.content or ""
        else:
            for chunk in client.completions.create(model=MODEL, prompt="hi", stream=True,
                                                   max_tokens=8):
                seen += chunk.choices[0].text
    assert seen == "x"
    assert isinstance(err.value.body, dict) and err.value.body["code"] == "decoding_error"


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_l4_k3_openai_non_streaming_is_500_not_retried(server: ScriptedServer, kind: str) -> None:
    """Non-streaming: HTTP 500 with ``x-should-retry: false`` (sent once despite the SDK's
    two retries), the error, the partial text (its choice's ``finish_reason`` null) and the
    ``coda`` object in the body."""
    client = oai(server)
    before = server.engine.num_requests_total
    with pytest.raises(openai.InternalServerError) as err:
        if kind == "chat":
            client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=8)
    assert server.engine.num_requests_total - before == 1
    resp = err.value.response
    assert resp.status_code == 500 and resp.headers["x-should-retry"] == "false"
    body = resp.json()
    assert body["error"]["code"] == "decoding_error"
    choice = body["choices"][0]
    assert (choice["message"]["content"] if kind == "chat" else choice["text"]) == "x"
    # NOTE: no OpenAI finish reason: the loop's eos read "stop", a natural end, on a choice
    # that failed (its stream sends no finish either); coda keeps the reason
    assert choice["finish_reason"] is None
    assert_failed_outcome(body["coda"])
    assert_failed_outcome(choice["coda"])


def test_l4_k3_anthropic_stream_error_event_and_non_streaming_500(server: ScriptedServer) -> None:
    """Anthropic: one in-band ``error`` event (the SDK raises), never ``end_turn``; the
    non-streaming answer is a 500 the SDK does not retry, carrying text and ``coda``."""
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 8,
                                                      "messages": MSG, "stream": True}, timeout=30)
    events = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert events[-1] == "error" and "message_stop" not in events
    err_frame = json.loads(sse_data(r.text)[-1])
    assert err_frame["error"]["type"] == "api_error"
    assert_failed_outcome(err_frame["coda"])
    assert "end_turn" not in r.text
    client = claude(server)
    with (pytest.raises(anthropic.APIStatusError),
          client.messages.stream(model=MODEL, max_tokens=8, messages=MSG) as stream):
        for _ in stream.text_stream:
            pass
    before = server.engine.num_requests_total
    with pytest.raises(anthropic.InternalServerError) as err:
        client.messages.create(model=MODEL, max_tokens=8, messages=MSG)
    assert server.engine.num_requests_total - before == 1
    resp = err.value.response
    assert resp.headers["x-should-retry"] == "false"
    body = resp.json()
    assert body["type"] == "error" and body["content"][0]["text"] == "x"
    assert_failed_outcome(body["coda"])


def test_l4_k3_responses_failed_stream_and_non_streaming(server: ScriptedServer) -> None:
    """Responses: ``response.failed`` with status ``failed`` and an ``error`` (never
    ``response.completed``); non-streaming: a 500 (not retried) whose body is the failed
    response with its partial output and ``coda``."""
    client = oai(server)
    events = list(client.responses.create(model=MODEL, input="hi", stream=True,
                                          max_output_tokens=16))
    kinds = [e.type for e in events]
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds
    final = events[-1].response
    assert final.status == "failed" and final.error is not None
    assert_failed_outcome(final.model_extra["coda"])  # type: ignore[index]
    assert final.output[0].content[0].text == "x"  # type: ignore[union-attr]
    before = server.engine.num_requests_total
    with pytest.raises(openai.InternalServerError) as err:
        client.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    assert server.engine.num_requests_total - before == 1
    resp = err.value.response
    assert resp.headers["x-should-retry"] == "false"
    body = resp.json()
    assert body["status"] == "failed" and body["output"][0]["content"][0]["text"] == "x"
    assert_failed_outcome(body["coda"])


def _metric(server: ScriptedServer, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_issue20_d7_l4_k3_failed_request_counts_as_failure_not_success(server: ScriptedServer) -> None:
    """Issue 20 D7 (L4, K3): a request that ends FAILED (decoding_error, reason ``eos``) is
    counted in ``coda:request_failure_total`` by reason and error code, never in
    ``coda:request_success_total`` (whose label is only the reason)."""
    ok = ("coda:request_success_total", {"finished_reason": "eos"})
    bad = ("coda:request_failure_total", {"finished_reason": "eos", "error": "decoding_error"})
    before = _metric(server, ok[0], **ok[1]), _metric(server, bad[0], **bad[1])
    r = httpx.post(server.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": MSG, "max_tokens": 8}, timeout=30)
    assert r.status_code == 500
    after = _metric(server, ok[0], **ok[1]), _metric(server, bad[0], **bad[1])
    assert after == (before[0], before[1] + 1)


def _stream_logprob_count(data: list[str], chat: bool) -> int:
    n = 0
    for d in data[:-1]:
        for c in json.loads(d).get("choices", []):
            lp = c.get("logprobs")
            n += len(lp["content"]) if chat and lp else len(lp["tokens"]) if lp else 0
    return n


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": MSG, "logprobs": True}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 0}),
])
def test_issue20_d8_l4_k3_failed_logprobs_equal_streamed_and_not(server: ScriptedServer, path: str,
                                                          body: dict[str, Any]) -> None:
    """Issue 20 D8 (L4, K3, L6): ``max_tokens: 2`` cuts ``x`` + ``0xC3`` and ``utf8_tail:
    fail`` ends the request FAILED (``max_output_tokens``). The streamed frames (deltas, then
    the chunk before the error frame) list as many logprobs entries as the 500 body: both
    selected tokens, the textless lead byte included."""
    req = {"model": MODEL, "max_tokens": 2, "utf8_tail": "fail", **body}
    plain = httpx.post(server.url + path, json=req, timeout=30)
    assert plain.status_code == 500
    choice = plain.json()["choices"][0]
    chat = path.endswith("chat/completions")
    n_plain = len(choice["logprobs"]["content"] if chat else choice["logprobs"]["tokens"])
    assert n_plain == 2
    streamed = httpx.post(server.url + path, json={**req, "stream": True}, timeout=30)
    data = sse_data(streamed.text)
    assert data[-1] == "[DONE]" and "error" in json.loads(data[-2])
    assert json.loads(data[-2])["coda"]["finish_reason"] == "max_output_tokens"
    assert _stream_logprob_count(data, chat) == n_plain
