"""Verifiable resume (issue 8, P3 extension; SPEC P2, P3): with ``stream_verify`` every delta
carries its byte offset and a running SHA-256 of the output; a resume names the offset (and
digest) it holds; any mismatch is a 409, never a silent splice."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import anthropic
import httpx
import openai

from tests.conftest import sse_events

MODEL = "tiny-chat"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 12,
        "stream": True, "ignore_eos": True, "seed": 5}



def _check_stamps(stamps: list[tuple[bytes, dict[str, Any]]]) -> None:
    held = b""
    for data, coda in stamps:
        assert coda["offset"] == len(held) and coda["length"] == len(data)
        held += data
        assert coda["digest"] == hashlib.sha256(held).hexdigest()


def test_p3_every_delta_carries_offset_and_running_digest(server_live: Any) -> None:
    """P2/P3: per choice (n = 2), each delta chunk's ``coda`` is (offset, length, digest) of
    the output so far; without the opt-in, deltas carry no ``coda``."""
    with httpx.stream("POST", server_live.url + "/v1/chat/completions",
                      json={**CHAT, "n": 2, "stream_verify": True}) as resp:
        events = sse_events(resp.read())
    per: dict[int, list[tuple[bytes, dict[str, Any]]]] = {0: [], 1: []}
    for ev in events[:-1]:
        chunk = json.loads(ev["data"])
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            choice = chunk["choices"][0]
            per[choice["index"]].append((choice["delta"]["content"].encode(), chunk["coda"]))
    assert per[0] and per[1]
    for stamps in per.values():
        _check_stamps(stamps)
    with httpx.stream("POST", server_live.url + "/v1/chat/completions", json=CHAT) as resp:
        plain = [json.loads(e["data"]) for e in sse_events(resp.read())[:-1]]
    assert not any("coda" in c for c in plain if c["choices"] and
                   c["choices"][0]["delta"].get("content"))


def test_p3_resume_by_offset_and_digest_replays_exactly_the_rest(server_live: Any) -> None:
    """P3: a resume naming (offset, digest) of a delta boundary replays exactly the live
    suffix after that delta; a wrong digest, an offset inside a delta, or one that disagrees
    with Last-Event-ID is a 409; malformed values are a 400."""
    with httpx.stream("POST", server_live.url + "/v1/chat/completions",
                      json={**CHAT, "stream_verify": True}) as resp:
        rid = resp.headers["x-request-id"]
        live = sse_events(resp.read())
    deltas = [(k, json.loads(e["data"])["coda"]) for k, e in enumerate(live[:-1])
              if "offset" in json.loads(e["data"]).get("coda", {})]
    assert len(deltas) >= 3
    k, coda = deltas[1]
    end = coda["offset"] + coda["length"]
    url = f"{server_live.url}/v1/streams/{rid}"
    r = httpx.get(url, params={"offset": end, "digest": coda["digest"]})
    assert r.status_code == 200 and sse_events(r.content) == live[k + 1:]
    assert httpx.get(url, params={"offset": 0}).status_code == 200
    bad = httpx.get(url, params={"offset": end, "digest": "0" * 64})
    assert bad.status_code == 409 and bad.json()["error"]["param"] == "digest"
    if deltas[2][1]["length"] > 1:
        inside = httpx.get(url, params={"offset": end + 1})
        assert inside.status_code == 409 and inside.json()["error"]["param"] == "offset"
    other = httpx.get(url, params={"offset": end}, headers={"Last-Event-ID": live[0]["id"]})
    assert other.status_code == 409
    assert httpx.get(url, params={"offset": "x"}).status_code == 400
    assert httpx.get(url, params={"digest": coda["digest"]}).status_code == 400


def test_p3_anthropic_and_responses_deltas_are_stamped(server_live: Any) -> None:
    """P3: the same stamps on Anthropic ``content_block_delta`` and Responses
    ``output_text.delta`` events (official clients, extra_body)."""
    ac = anthropic.Anthropic(base_url=server_live.url, api_key="unused", max_retries=0)
    stamps = []
    with ac.messages.stream(model=MODEL, max_tokens=8, messages=[{"role": "user",
                            "content": "hi"}], extra_body={"stream_verify": True,
                                                           "ignore_eos": True}) as s:
        for ev in s:
            if ev.type == "content_block_delta":
                stamps.append((ev.delta.text.encode(), ev.model_extra["coda"]))  # type: ignore[union-attr]
    assert stamps
    _check_stamps(stamps)
    oc = openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)
    stamps = []
    with oc.responses.create(model=MODEL, input="hi", max_output_tokens=16, stream=True,
                             extra_body={"stream_verify": True, "ignore_eos": True}) as s:
        for ev in s:
            if ev.type == "response.output_text.delta":
                stamps.append((ev.delta.encode(), ev.model_extra["coda"]))  # type: ignore[union-attr]
    assert stamps
    _check_stamps(stamps)


def test_p3_responses_resume_by_offset(server_live: Any) -> None:
    """P3: ``GET /v1/responses/{id}?stream=true&offset=N&digest=HEX`` replays exactly the
    events after the delta ending at byte N; a wrong digest or an offset that disagrees with
    ``starting_after`` is a 409."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "stream": True,
            "ignore_eos": True, "stream_verify": True}
    with httpx.stream("POST", server_live.url + "/v1/responses", json=body) as resp:
        live = sse_events(resp.read())
    rid = json.loads(live[0]["data"])["response"]["id"]
    deltas = [(k, json.loads(e["data"])["coda"]) for k, e in enumerate(live)
              if e["event"] == "response.output_text.delta"]
    assert len(deltas) >= 2
    k, coda = deltas[1]
    end = coda["offset"] + coda["length"]
    url = f"{server_live.url}/v1/responses/{rid}"
    r = httpx.get(url, params={"stream": "true", "offset": end, "digest": coda["digest"]})
    assert r.status_code == 200 and sse_events(r.content) == live[k + 1:]
    r = httpx.get(url, params={"stream": "true", "offset": 0})
    # NOTE: no byte held: every event after the start's, the message item's announcement
    # included (it comes with the first delta, as OpenAI's)
    added = next(k for k, e in enumerate(live) if e["event"] == "response.output_item.added")
    assert live[added - 1]["event"] == "response.in_progress"
    assert sse_events(r.content) == live[added:]
    bad = httpx.get(url, params={"stream": "true", "offset": end, "digest": "ab" * 32})
    assert bad.status_code == 409
    other = httpx.get(url, params={"stream": "true", "offset": end, "starting_after": 0})
    assert other.status_code == 409


def test_p3_an_offset_that_is_no_byte_count_is_a_400(server_live: Any) -> None:
    """P3: ``offset`` is a byte count as a client counts it: ``+N``, ``-1``, ``1_2`` are a
    400 naming ``offset`` (malformed; Responses here, ``/v1/streams`` shares the parser). Before, ``int()``
    read ``+N`` as the boundary N (a 200 resume) and ``-1`` was a 409 ``resume_mismatch``
    saying the output had 0 bytes."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 16, "stream": True,
            "ignore_eos": True, "stream_verify": True}
    with httpx.stream("POST", server_live.url + "/v1/responses", json=body) as resp:
        live = sse_events(resp.read())
    rid = json.loads(live[0]["data"])["response"]["id"]
    coda = [json.loads(e["data"])["coda"] for e in live
            if e["event"] == "response.output_text.delta"][1]
    end = coda["offset"] + coda["length"]
    url = f"{server_live.url}/v1/responses/{rid}"
    assert httpx.get(url, params={"stream": "true", "offset": str(end)}).status_code == 200
    for bad in (f"+{end}", "-1", f"{end // 10}_{end % 10}" if end >= 10 else f"0_{end}"):
        r = httpx.get(url, params={"stream": "true", "offset": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "offset", (bad, r.text)


def test_p3_an_offset_off_a_boundary_names_the_boundaries_around_it(server_live: Any) -> None:
    """P3: the 409 for an offset inside a delta names that offset and the delta boundaries
    either side of it; one past the output names the output's length (it said the bytes
    before the delta holding the offset, as if that were the output's length)."""
    with httpx.stream("POST", server_live.url + "/v1/chat/completions",
                      json={**CHAT, "stream_verify": True}) as resp:
        rid = resp.headers["x-request-id"]
        live = sse_events(resp.read())
    stamps = [json.loads(e["data"])["coda"] for e in live[:-1]
              if "offset" in json.loads(e["data"]).get("coda", {})]
    total = stamps[-1]["offset"] + stamps[-1]["length"]
    wide = next(c for c in stamps if c["length"] > 1 and c["offset"] > 0)
    inside = wide["offset"] + 1
    url = f"{server_live.url}/v1/streams/{rid}"
    r = httpx.get(url, params={"offset": inside})
    assert r.status_code == 409
    assert r.json()["error"]["message"] == (
        f"offset {inside} of choice 0 is inside a delta: the nearest delta boundaries are "
        f"{wide['offset']} and {wide['offset'] + wide['length']} (the output has {total} "
        f"bytes so far)")
    past = httpx.get(url, params={"offset": total + 5})
    assert past.status_code == 409
    assert past.json()["error"]["message"] == (
        f"offset {total + 5} of choice 0 is past the end of the output ({total} bytes so far)")
