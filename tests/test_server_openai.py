"""Live-server tests of /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics
with the official ``openai`` client and raw SSE (issue 4; SPEC P1–P4, L3–L6, S3, G3, C1)."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import SSEAccumulator

MODEL = "tiny-chat"
MSG = [{"role": "user", "content": "Hello world"}]


@pytest.fixture
def client(server_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)


def sse_events(resp: httpx.Response) -> list[dict[str, Any]]:
    """Parse an SSE body into [{"id", "event", "data"}] (comments skipped)."""
    out, cur = [], {}
    for line in resp.iter_lines():
        if not line:
            if cur:
                out.append(cur)
            cur = {}
        elif line.startswith(":"):
            continue
        else:
            key, _, value = line.partition(": ")
            cur[key] = value
    if cur:
        out.append(cur)
    return out


def test_models_health_metrics(server_live: Any, client: openai.OpenAI) -> None:
    """/v1/models lists the served model; /health is ok; /metrics has the vLLM-style names."""
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server_live.url + "/health").json()["status"] == "ok"
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    text = httpx.get(server_live.url + "/metrics").text
    for name in ("coda:time_to_first_token_seconds", "coda:inter_token_latency_seconds",
                 "coda:request_queue_time_seconds", "coda:e2e_request_latency_seconds",
                 "coda:num_requests_running", "coda:num_requests_waiting",
                 "coda:kv_cache_usage_perc", 'coda:request_success_total{finished_reason='):
        assert name in text, name


def test_chat_non_streaming_l4_l6_exact_reason_and_split_usage(client: openai.OpenAI) -> None:
    """L4/L6: closest OpenAI reason plus the exact one, split usage and timings in ``coda``."""
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    ext = choice.model_extra["coda"]
    assert ext["finish_reason"] == "max_output_tokens" and ext["state"] == "FINISHED"
    assert ext["usage"]["selected_tokens"] == 6 == r.usage.completion_tokens
    assert set(ext["timings"]) >= {"queue_s", "prefill_s", "decode_s", "stop_buffer_s"}
    assert len(choice.logprobs.content) == ext["usage"]["returned_tokens"]
    assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
    assert "".join(e.token for e in choice.logprobs.content).strip() in choice.message.content \
        or choice.message.content


def test_chat_streaming_p1_p2_ids_and_usage(server_live: Any, client: openai.OpenAI) -> None:
    """P1/P2: SSE ids strictly increase; exactly one final chunk, then usage, then [DONE]."""
    with httpx.stream("POST", server_live.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": MSG, "max_tokens": 8, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as resp:
        events = sse_events(resp)
    assert events[-1]["data"] == "[DONE]"
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    ids = [int(e["id"]) for e in events[:-2]]
    assert ids == sorted(set(ids)) and ids[0] == 0
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and chunks.index(finals[0]) == len(chunks) - 2
    assert chunks[-1]["usage"]["completion_tokens"] == 8 and chunks[-1]["choices"] == []
    streamed = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4,
                                              stream=True, extra_body={"ignore_eos": True})
    parts = list(streamed)
    assert parts[0].choices[0].delta.role == "assistant"
    assert parts[-1].choices[0].finish_reason == "length"


def test_chat_n2_seeds_and_reproducibility(client: openai.OpenAI) -> None:
    """n>1 submits n requests with seeds seed+i; the same seed reproduces the same text."""
    a = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, n=2, seed=7)
    b = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, n=1, seed=8)
    assert [c.index for c in a.choices] == [0, 1]
    assert a.choices[1].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens == 16


def test_stop_strings_never_leak_s3_l3(client: openai.OpenAI) -> None:
    """S3/L3: the matched stop and everything after it never reach the client; the exact
    reason is stop_sequence with the matched string, in streaming and not."""
    full = client.completions.create(model=MODEL, prompt="The quick", max_tokens=24,
                                     temperature=0).choices[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    r = client.completions.create(model=MODEL, prompt="The quick", max_tokens=24,
                                  temperature=0, stop=[stop, "\u00a7never"])
    c = r.choices[0]
    assert c.text == cut and c.finish_reason == "stop"
    assert c.model_extra["coda"]["finish_reason"] == "stop_sequence"
    assert c.model_extra["coda"]["matched_stop"] == stop
    text = "".join(ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt="The quick", max_tokens=24, temperature=0, stop=stop, stream=True)
        if ch.choices)
    assert text == cut and stop not in text
    kept = client.completions.create(model=MODEL, prompt="The quick", max_tokens=24,
                                     temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop


def test_completions_token_prompt_and_legacy_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=5, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 5
    # NOTE: the 3 best, and the sampled token where it is not among them (OpenAI's logprobs+1)
    assert all(len(t) <= 4 and tok in t for tok, t in zip(lp.tokens, lp.top_logprobs, strict=True))
    assert lp.text_offset == sorted(lp.text_offset)
    assert r.usage.prompt_tokens == 4
    batch = client.completions.create(model=MODEL, prompt=["a b", "c d"], max_tokens=2)
    assert [c.index for c in batch.choices] == [0, 1]


def test_deadline_is_deadline_exceeded_g3(client: openai.OpenAI) -> None:
    """G3: a deadline ends the request deadline_exceeded, never cancelled."""
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=400,
                                       extra_body={"deadline": 0.05, "ignore_eos": True})
    ext = r.choices[0].model_extra["coda"]
    assert ext["finish_reason"] == "deadline_exceeded" and r.choices[0].finish_reason == "length"


def test_disconnect_cancels_foreground_p4_l5(server_live: Any, server_settle: Any) -> None:
    """P4/L5: a client disconnect cancels a foreground stream as transport_error (never eos);
    the stored log shows it through the resume endpoint."""
    with httpx.stream("POST", server_live.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": MSG, "max_tokens": 400, "stream": True,
            "ignore_eos": True}) as resp:
        rid = resp.headers["x-request-id"]
        for line in resp.iter_lines():
            if line.startswith("data:") and '"content":"' in line and '"content":""' not in line:
                break
    server_settle()
    with httpx.stream("GET", f"{server_live.url}/v1/streams/{rid}") as resp:
        events = sse_events(resp)
    final = json.loads(events[-2]["data"])
    assert final["coda"]["finish_reason"] == "transport_error"
    assert final["choices"][0]["finish_reason"] != "stop"


def test_continue_policy_resume_with_last_event_id_p3(server_live: Any) -> None:
    """P3: with on_disconnect=continue the request survives the disconnect; Last-Event-ID
    resumes after the last seen sequence number and the merged text is the full text."""
    body = {"model": MODEL, "messages": MSG, "max_tokens": 60, "stream": True, "seed": 3,
            "on_disconnect": "continue", "ignore_eos": True}
    seen: list[str] = []
    last = None
    with httpx.stream("POST", server_live.url + "/v1/chat/completions", json=body) as resp:
        rid = resp.headers["x-request-id"]
        for e in sse_events_iter(resp):
            last = e["id"]
            seen += [c["delta"].get("content", "") for c in json.loads(e["data"])["choices"]]
            if int(last) >= 3:
                break
    with httpx.stream("GET", f"{server_live.url}/v1/streams/{rid}",
                      headers={"Last-Event-ID": last}) as resp:
        rest = sse_events(resp)
    assert int(rest[0]["id"]) == int(last) + 1
    for e in rest[:-1]:
        seen += [c["delta"].get("content", "") for c in json.loads(e["data"])["choices"]]
    final = json.loads(rest[-2]["data"])
    assert final["coda"]["finish_reason"] == "max_output_tokens"
    full = httpx.post(server_live.url + "/v1/chat/completions",
                      json={**body, "stream": False}).json()
    assert "".join(seen) == full["choices"][0]["message"]["content"]


def sse_events_iter(resp: httpx.Response) -> Any:
    sse = SSEAccumulator()
    for line in resp.iter_lines():
        event = sse.feed(line)
        if event is not None:
            yield event


BAD = [
    ({"messages": MSG}, "model"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": MSG, "temperature": 3}, "temperature"),
    ({"model": MODEL, "messages": MSG, "top_p": -0.1}, "top_p"),  # NOTE: 0 is valid (OpenAI)
    ({"model": MODEL, "messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "messages": MSG, "max_tokens": 100000}, "max_tokens"),
    ({"model": MODEL, "messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": MODEL, "messages": MSG, "stop": ["x" * 300]}, "stop"),
    ({"model": MODEL, "messages": MSG, "stop": ["ok\ud800"]}, "stop"),  # S1: lone surrogate
    ({"model": MODEL, "messages": MSG, "n": 0}, "n"),
    ({"model": MODEL, "messages": MSG, "logit_bias": {"99999": 1}}, "logit_bias"),
    ({"model": MODEL, "messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"model": MODEL, "messages": MSG, "deadline": -1}, "deadline"),
    ({"model": MODEL, "messages": MSG, "early_stop": {"bogus": 1}}, "early_stop.bogus"),
    ({"model": MODEL, "messages": MSG, "frobnicate": 1}, "frobnicate"),
    ({"model": MODEL, "messages": MSG, "stop_token_ids": [[]]}, "stop_token_ids"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x " * 2000}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_field(server_live: Any, body: dict[str, Any],
                                           param: str) -> None:
    # NOTE: ASCII-escaped JSON, so a lone surrogate travels as the client would send it
    r = httpx.post(server_live.url + "/v1/chat/completions", content=json.dumps(body),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert param.split(".")[0] in err["message"]


def test_unknown_model_404_malformed_json_400(server_live: Any) -> None:
    r = httpx.post(server_live.url + "/v1/chat/completions",
                   json={"model": "nope", "messages": MSG})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(server_live.url + "/v1/completions", content=b'{"model": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_key_401_in_protocol_shape(server_spawn: Any) -> None:
    live = server_spawn(api_key="sekret")
    r = httpx.post(live.url + "/v1/chat/completions", json={"model": MODEL, "messages": MSG})
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.post(live.url + "/v1/messages", json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    ok = openai.OpenAI(base_url=live.url + "/v1", api_key="sekret", max_retries=0)
    assert ok.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2).choices
    assert httpx.get(live.url + "/health").status_code == 200


def test_keepalive_comments_are_valid_sse(server_spawn: Any) -> None:
    """Keepalive comments (while queued / prefilling / quiet) never break the client."""
    from coda.server.state import ServerSettings

    live = server_spawn(settings=ServerSettings(keepalive_s=0.001))
    raw = httpx.post(live.url + "/v1/completions", json={
        "model": MODEL, "prompt": "a", "max_tokens": 30, "stream": True,
        "ignore_eos": True}).text
    assert ": keepalive" in raw
    c = openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)
    chunks = list(c.completions.create(model=MODEL, prompt="a", max_tokens=30, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_l6_usage_counts_every_prompt_of_a_batched_completion(client: openai.OpenAI) -> None:
    """Usage of a batch of prompts × n choices: each prompt once, every choice's tokens."""
    one = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, seed=1,
                                    extra_body={"ignore_eos": True})
    two = client.completions.create(model=MODEL, prompt="World", max_tokens=3, seed=1,
                                    extra_body={"ignore_eos": True})
    both = client.completions.create(model=MODEL, prompt=["Hello there", "World"], max_tokens=3,
                                     n=2, seed=1, extra_body={"ignore_eos": True})
    assert len(both.choices) == 4
    assert both.usage.prompt_tokens == one.usage.prompt_tokens + two.usage.prompt_tokens
    assert both.usage.completion_tokens == 12


def test_l6_logprobs_cover_every_token_of_a_length_limited_output(client: openai.OpenAI) -> None:
    """Every selected token of a max_tokens ending gets a logprob entry, textless ones too,
    streamed or not (L6: selected tokens are what is billed)."""
    for seed in range(6):
        kw: dict[str, Any] = dict(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, logprobs=1,
                                  seed=seed, extra_body={"ignore_eos": True})
        r = client.completions.create(**kw)
        assert len(r.choices[0].logprobs.tokens) == r.usage.completion_tokens == 6
        n = sum(len(c.choices[0].logprobs.tokens) for c in client.completions.create(
            stream=True, **kw) if c.choices and c.choices[0].logprobs)
        assert n == 6
        chat = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6,
                                              logprobs=True, seed=seed,
                                              extra_body={"ignore_eos": True})
        assert len(chat.choices[0].logprobs.content) == 6


def test_p5_streamed_timings_include_a_measured_network_send(server_live: Any) -> None:
    """P5: the final chunk's ``coda.timings`` carries every phase; network_send_s is measured
    (frames were written before it) and no phase exceeds the client's own wall time."""
    t0 = time.perf_counter()
    with httpx.stream("POST", server_live.url + "/v1/chat/completions", json={
            "model": MODEL, "messages": MSG, "max_tokens": 6, "stream": True,
            "ignore_eos": True}) as resp:
        events = sse_events(resp)
    wall = time.perf_counter() - t0
    chunks = [json.loads(e["data"]) for e in events[:-1]]
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    tm = final["coda"]["timings"]
    # NOTE: recorded when the terminal is first rendered: 0.0 when every frame was still queued
    # behind the pump then (a loaded machine), never more than the client's wall time
    assert 0.0 <= tm["network_send_s"] < wall
    assert tm["decode_s"] > 0.0 and tm["prefill_s"] > 0.0 and tm["total_s"] < wall
    assert abs(tm["queue_s"] + tm["prefill_s"] + tm["decode_s"] - tm["total_s"]) < 1e-6


def test_p3_the_call_record_is_born_at_parse_and_keeps_no_prompt_once_submitted(
        server_engine: Any) -> None:
    """P3 (issue 22: one holder of the call): the record the store keeps for replay is the one
    the adapter's parse made (its kind, model and spec), with its handles filled by the create
    handler and its engine requests (the prompt ids) let go once submitted."""
    from coda.server.app import create_app
    from tests.conftest import LiveServer

    app = create_app(server_engine, manage_engine=False)
    live = LiveServer(app).start()
    try:
        client = openai.OpenAI(api_key="x", base_url=live.url + "/v1")
        done = client.chat.completions.create(
            model=server_engine.model_name, max_tokens=4,
            messages=[{"role": "user", "content": "hi"}])
        record = app.state.coda.store.get(done.id)
        assert record is not None and record.kind == "chat"
        assert record.model == server_engine.model_name and len(record.handles) == 1
        assert record.requests == () and record.stream is False
    finally:
        live.stop()
