"""Bounded load test: 240 concurrent SSE streams over three protocols, ~30% of them
disconnected, cancelled or past a deadline at random (issue 4 item 7; SPEC P2, L2, L3, L5,
L7, G3, C1). Every stream's invariants hold, every KV block is free afterwards, no server task
leaks. Prints p50/p99 time to first token (run with ``-s``)."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from typing import Any

import httpx

from tests.conftest import SSEAccumulator
from tests.test_server_openai import MODEL

N_STREAMS = 240
FINAL_RESPONSES = {"response.completed", "response.incomplete", "response.failed"}


async def _events(resp: httpx.Response) -> Any:
    sse = SSEAccumulator()
    async for line in resp.aiter_lines():
        event = sse.feed(line)
        if event is not None:
            yield event


def _request(kind: str, i: int, fate: str) -> tuple[str, dict[str, Any]]:
    ext: dict[str, Any] = {"seed": i, "ignore_eos": True}
    if fate == "deadline":
        ext["deadline"] = 0.01
    if kind == "chat":
        return "/v1/chat/completions", {"model": MODEL, "stream": True, "max_tokens": 12,
                                        "messages": [{"role": "user", "content": f"n{i}"}],
                                        **ext}
    if kind == "responses":
        return "/v1/responses", {"model": MODEL, "stream": True, "max_output_tokens": 16,
                                 "input": f"n{i}", **ext}
    return "/v1/messages", {"model": MODEL, "stream": True, "max_tokens": 12,
                            "messages": [{"role": "user", "content": f"n{i}"}], **ext}


def _is_final(kind: str, ev: dict[str, str]) -> bool:
    if kind == "chat":
        data = json.loads(ev["data"]) if ev["data"] != "[DONE]" else {}
        return "error" in data or any(c.get("finish_reason") for c in data.get("choices", []))
    if kind == "responses":
        return ev.get("event") in FINAL_RESPONSES
    return ev.get("event") in ("message_stop", "error")


def _check(kind: str, events: list[dict[str, str]], complete: bool) -> str | None:
    """P2/L3 on one stream; returns the exact finish reason when the stream is complete."""
    # NOTE: an id is the engine positions, or inside a frame group "<positions before>.<k>"
    ids = [tuple(int(x) for x in e["id"].split(".")) for e in events
           if e.get("data") != "[DONE]"]
    strict = kind != "anthropic"
    assert all((a < b) if strict else (a <= b) for a, b in zip(ids, ids[1:], strict=False)), ids
    finals = [i for i, e in enumerate(events) if _is_final(kind, e)]
    if not complete:
        assert not finals
        return None
    assert len(finals) == 1, events
    after = events[finals[0] + 1:]
    if kind == "chat":  # only the usage chunk / [DONE] may follow the final chunk
        assert [e["data"] for e in after] == ["[DONE]"]
        return str(json.loads(events[finals[0]]["data"])["coda"]["finish_reason"])
    assert not after
    data = json.loads(events[finals[0]]["data"])
    if kind == "responses":
        return str(data["response"]["coda"]["finish_reason"])
    if "coda" not in data:  # message_stop: the exact outcome rides on message_delta
        data = json.loads(events[finals[0] - 1]["data"])
        assert data["type"] == "message_delta"
    return str(data["coda"]["finish_reason"])


async def _one(client: httpx.AsyncClient, i: int, rng: random.Random,
               ttft: list[float]) -> tuple[str, str, str, str | None]:
    kind = rng.choice(["chat", "chat", "responses", "anthropic"])
    fate = rng.choices(["normal", "disconnect", "cancel", "deadline"], [70, 12, 8, 10])[0]
    if fate == "cancel" and kind != "responses":
        fate = "disconnect"
    path, body = _request(kind, i, fate)
    events: list[dict[str, str]] = []
    t0 = time.perf_counter()
    rid = None
    async with client.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        rid = resp.headers.get("x-request-id") or resp.headers.get("request-id")
        async for ev in _events(resp):
            events.append(ev)
            if len(events) == 1 and kind == "responses":
                rid = json.loads(ev["data"])["response"]["id"]
            if len(ttft) < N_STREAMS and "delta" in ev.get("data", "") and not any(
                    "_ttft" in e for e in events):
                ev["_ttft"] = "1"
                ttft.append(time.perf_counter() - t0)
            if fate == "disconnect" and len(events) >= 2 + i % 3:
                break  # NOTE: leaving the context closes the connection mid-stream
            if fate == "cancel" and len(events) == 4:
                await client.post(f"/v1/requests/{rid}/cancel")  # NOTE: foreground: C1
    complete = fate != "disconnect" or any(_is_final(kind, e) for e in events)
    reason = _check(kind, [{k: v for k, v in e.items() if k != "_ttft"} for e in events],
                    complete)
    return kind, fate, str(rid), reason


async def _after_disconnect(client: httpx.AsyncClient, kind: str, rid: str) -> str:
    """The exact reason a disconnected request ended with (read back from the server)."""
    if kind == "responses":
        for _ in range(200):
            body = (await client.get(f"/v1/responses/{rid}")).json()
            if "coda" in body:
                return str(body["coda"]["finish_reason"])
            await asyncio.sleep(0.02)
        raise AssertionError("no terminal")
    events = []
    async with client.stream("GET", f"/v1/streams/{rid}") as resp:
        async for ev in _events(resp):
            events.append(ev)
    return str(_check(kind, events, True))


def test_load_240_streams_with_30pct_disruptions_p2_l3_l7(server_spawn: Any,
                                                          server_engine: Any,
                                                          server_settle: Any) -> None:
    from coda.server.state import ServerSettings

    live = server_spawn(settings=ServerSettings(keepalive_s=0.5))
    loop = live.server.servers[0].get_loop()

    async def count_tasks() -> int:
        return len(asyncio.all_tasks())

    baseline = asyncio.run_coroutine_threadsafe(count_tasks(), loop).result(5)
    rng = random.Random(1234)
    ttft: list[float] = []

    async def main() -> list[tuple[str, str, str, str | None]]:
        limits = httpx.Limits(max_connections=N_STREAMS + 20, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=live.url, limits=limits, timeout=60) as client:
            results = await asyncio.gather(*(_one(client, i, rng, ttft)
                                             for i in range(N_STREAMS)))
            fixed = []
            for kind, fate, rid, reason in results:
                if reason is None:
                    reason = await _after_disconnect(client, kind, rid)
                fixed.append((kind, fate, rid, reason))
            return fixed

    t0 = time.perf_counter()
    results = asyncio.run(main())
    wall = time.perf_counter() - t0
    by_fate: dict[str, list[str | None]] = {}
    for _, fate, _, reason in results:
        by_fate.setdefault(fate, []).append(reason)
    # L5 / G3 / C1: each disruption ends with its own exact reason.
    assert all(r in ("transport_error", "max_output_tokens") for r in by_fate["disconnect"])
    assert "transport_error" in by_fate["disconnect"]
    assert all(r == "cancelled" or r == "max_output_tokens" for r in by_fate.get("cancel", []))
    assert all(r in ("deadline_exceeded", "max_output_tokens") for r in by_fate["deadline"])
    assert "deadline_exceeded" in by_fate["deadline"]
    assert set(by_fate["normal"]) == {"max_output_tokens"}
    disrupted = len(results) - len(by_fate["normal"])
    assert 0.2 * N_STREAMS <= disrupted <= 0.4 * N_STREAMS
    stats = server_settle()
    assert stats.num_free_blocks == stats.num_blocks, stats  # L7: nothing leaked
    time.sleep(0.2)
    leaked = asyncio.run_coroutine_threadsafe(count_tasks(), loop).result(5) - baseline
    assert leaked <= 0, f"{leaked} server tasks leaked"
    ttft.sort()
    p50, p99 = statistics.median(ttft), ttft[int(0.99 * (len(ttft) - 1))]
    print(f"\n[load] streams={N_STREAMS} disrupted={disrupted} "
          f"({', '.join(f'{k}={len(v)}' for k, v in sorted(by_fate.items()))}) "
          f"wall={wall:.2f}s TTFT p50={p50 * 1000:.1f}ms p99={p99 * 1000:.1f}ms "
          f"leaked_blocks={stats.num_blocks - stats.num_free_blocks} leaked_tasks={leaked}")
