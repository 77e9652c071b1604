"""Live-server tests of the Responses API and the Anthropic Messages API with the official
clients and raw SSE (issue 4; SPEC P1–P4, C1, L2–L5)."""

from __future__ import annotations

import json
import time
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.test_server_openai import MODEL, sse_events

FINALS = {"response.completed", "response.incomplete", "response.failed"}


def check_responses_stream(events: list[dict[str, Any]], first: int = 0) -> None:
    """P2: sequence_number == SSE id, from ``first`` in steps of 1; event: == data.type;
    exactly one final event, last."""
    seqs = [json.loads(e["data"])["sequence_number"] for e in events]
    assert seqs == list(range(first, first + len(events)))
    assert [int(e["id"]) for e in events] == seqs
    assert all(e["event"] == json.loads(e["data"])["type"] for e in events)
    kinds = [e["event"] for e in events]
    assert sum(k in FINALS for k in kinds) == 1 and kinds[-1] in FINALS


def test_responses_non_streaming_and_stream_p1_p2(oa: openai.OpenAI,
                                                  server_live: Any) -> None:
    # NOTE: ignore_eos: an unseeded random model may pick EOS; these assert a length ending
    r = oa.responses.create(model=MODEL, input="Hello", max_output_tokens=16,
                                extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.model_extra["coda"]["finish_reason"] == "max_output_tokens"
    assert r.usage.output_tokens == 16 and r.output_text
    types = [e.type for e in oa.responses.create(model=MODEL, input="Hello",
                                                     max_output_tokens=16, stream=True,
                                                     extra_body={"ignore_eos": True})]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-1] == "response.incomplete"
    with httpx.stream("POST", server_live.url + "/v1/responses", json={
            "model": MODEL, "input": [{"role": "user", "content": "hi"}], "stream": True,
            "max_output_tokens": 16, "instructions": "be brief"}) as resp:
        check_responses_stream(sse_events(resp))


def test_responses_background_get_replay_cancel_p3_c1(oa: openai.OpenAI,
                                                      server_live: Any) -> None:
    """Background responses run without a client; GET replays the stored log from any
    starting_after (0 included) identically; cancel is idempotent and returns the final."""
    bg = oa.responses.create(model=MODEL, input="Hello", max_output_tokens=30,
                                 background=True, extra_body={"seed": 1})
    assert bg.status == "queued"
    deadline = time.monotonic() + 20
    while oa.responses.retrieve(bg.id).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    final = oa.responses.retrieve(bg.id)
    url = f"{server_live.url}/v1/responses/{bg.id}"
    with httpx.stream("GET", url, params={"stream": "true"}) as resp:
        everything = sse_events(resp)
    check_responses_stream(everything)
    text = "".join(json.loads(e["data"])["delta"] for e in everything
                   if e["event"] == "response.output_text.delta")
    assert text == final.output_text
    for n in (0, 3, len(everything) - 2):
        with httpx.stream("GET", url, params={"stream": "true", "starting_after": n}) as resp:
            tail = sse_events(resp)
        check_responses_stream(tail, first=n + 1)
        assert tail == everything[n + 1:]
    with httpx.stream("GET", url, params={"stream": "true"},
                      headers={"Last-Event-ID": "4"}) as resp:
        assert sse_events(resp) == everything[5:]
    again = oa.responses.cancel(bg.id)
    assert again.status == final.status and again.output_text == final.output_text


def test_responses_cancel_running_background_c1_l2(oa: openai.OpenAI) -> None:
    bg = oa.responses.create(model=MODEL, input="Hello", max_output_tokens=400,
                                 background=True, extra_body={"ignore_eos": True})
    first = oa.responses.cancel(bg.id)
    second = oa.responses.cancel(bg.id)
    assert first.status == second.status == "cancelled"
    assert first.model_extra["coda"]["finish_reason"] == "cancelled"
    assert first.output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        oa.responses.retrieve("resp_missing")


def test_responses_cancel_foreground_is_openai_400_c1(oa: openai.OpenAI,
                                                      server_live: Any) -> None:
    """C1, as OpenAI: only a ``background: true`` response is cancelled by
    ``/v1/responses/{id}/cancel``; a foreground one (finished, or a stream still running) is a
    400 ``invalid_request_error`` that changes nothing, and Coda's
    ``/v1/requests/{id}/cancel`` ends the running one, once, ``cancelled``."""
    done = oa.responses.create(model=MODEL, input="Hello", max_output_tokens=16)
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.cancel(done.id)
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert "background=true" in body["message"]
    assert oa.responses.retrieve(done.id).status == done.status
    with oa.responses.create(model=MODEL, input="Hello", max_output_tokens=400, stream=True,
                             extra_body={"ignore_eos": True}) as stream:
        events = iter(stream)
        rid = next(events).response.id
        next(e for e in events if e.type == "response.output_text.delta")
        with pytest.raises(openai.BadRequestError):
            oa.responses.cancel(rid)
        got = httpx.post(f"{server_live.url}/v1/requests/{rid}/cancel").json()
        assert got == {"id": rid, "object": "request.cancel", "cancelled": True}
        finals = [e for e in events if e.type in FINALS]
    assert len(finals) == 1 and finals[0].response.status == "cancelled"
    assert oa.responses.retrieve(rid).status == "cancelled"


def test_responses_bad_input_400(server_live: Any) -> None:
    for body, param in [({"model": MODEL}, "input"),
                        ({"model": MODEL, "input": [{"role": "bot", "content": "x"}]},
                         "input.0.role"),
                        ({"model": MODEL, "input": "x", "max_output_tokens": 0},
                         "max_output_tokens")]:
        r = httpx.post(server_live.url + "/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_anthropic_messages_and_stream_event_order(an: anthropic.Anthropic,
                                                   server_live: Any) -> None:
    m = an.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "user", "content": "Hello"}], system="sys",
                               extra_body={"ignore_eos": True})
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 5
    assert m.model_extra["coda"]["finish_reason"] == "max_output_tokens"
    with an.messages.stream(model=MODEL, max_tokens=5,
                                messages=[{"role": "user", "content": "Hello"}],
                                extra_body={"ignore_eos": True}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "max_tokens"
    with httpx.stream("POST", server_live.url + "/v1/messages", json={
            "model": MODEL, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hi"}]}) as resp:
        events = sse_events(resp)
    kinds = [e["event"] for e in events]
    assert kinds[:3] == ["message_start", "content_block_start", "ping"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert all(e["id"] for e in events)


def test_anthropic_stop_sequence_value_s3(an: anthropic.Anthropic) -> None:
    """The matched stop string comes back as ``stop_sequence``, never in the text."""
    full = an.messages.create(model=MODEL, max_tokens=24, extra_body={"top_k": 1},
                                  messages=[{"role": "user", "content": "Hello"}])
    text = full.content[0].text
    stop = text[4:7]
    m = an.messages.create(model=MODEL, max_tokens=24, extra_body={"top_k": 1}, stop_sequences=[stop],
                               messages=[{"role": "user", "content": "Hello"}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_anthropic_bad_input_shape(server_live: Any) -> None:
    for body, word in [({"model": MODEL, "messages": [{"role": "user", "content": "x"}]},
                        "max_tokens"),
                       ({"model": MODEL, "max_tokens": 5,
                         "messages": [{"role": "system", "content": "x"}]}, "role"),
                       ({"model": "nope", "max_tokens": 5,
                         "messages": [{"role": "user", "content": "x"}]}, "model")]:
        r = httpx.post(server_live.url + "/v1/messages", json=body)
        assert 400 <= r.status_code < 500
        err = r.json()
        assert err["type"] == "error" and word in err["error"]["message"], err
