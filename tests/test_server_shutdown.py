"""Graceful shutdown: open SSE streams end with their single terminal event (cancelled, cause
shutdown) and close; nothing is cut mid-stream, every KV block is freed (issue 4 item 1;
SPEC L2, L3, L7, P2)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import LiveServer
from tests.test_server_openai import MODEL, sse_events_iter


def _read_until_delta(events: Any, marker: str) -> list[dict[str, str]]:
    got = []
    for e in events:
        got.append(e)
        if marker in e.get("data", ""):
            return got
    raise AssertionError("stream ended before its first delta")


def test_graceful_shutdown_sends_final_events_l2_l3(server_checkpoint: Path) -> None:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(max_num_seqs=8))
    live = LiveServer(create_app(engine)).start()  # NOTE: the app owns (starts/stops) the engine
    body = {"model": MODEL, "stream": True, "max_tokens": 500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hello"}]}
    with httpx.Client(base_url=live.url, timeout=30) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as chat, \
            client.stream("POST", "/v1/messages", json=body) as msgs:
        chat_events, msg_events = sse_events_iter(chat), sse_events_iter(msgs)
        seen_chat = _read_until_delta(chat_events, '"content":"')
        seen_msg = _read_until_delta(msg_events, "text_delta")
        stopper = threading.Thread(target=live.stop)
        stopper.start()
        seen_chat += list(chat_events)
        seen_msg += list(msg_events)
        stopper.join(30)
    assert seen_chat[-1]["data"] == "[DONE]"
    final = json.loads(seen_chat[-2]["data"])
    assert final["coda"]["finish_reason"] == "cancelled"
    assert sum(1 for e in seen_chat if '"finish_reason":"' in e["data"]) == 1
    kinds = [e["event"] for e in seen_msg]
    assert kinds[-2:] == ["message_delta", "message_stop"] and kinds.count("message_stop") == 1
    assert json.loads(seen_msg[-2]["data"])["coda"]["finish_reason"] == "cancelled"
    stats = engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


def test_shared_engine_app_stop_cancels_only_its_requests_l7(server_spawn: Any,
                                                              server_engine: Any,
                                                              server_settle: Any) -> None:
    """An app that does not own the engine ends its own streams on stop; the engine lives on."""
    live = server_spawn()
    body = {"model": MODEL, "stream": True, "max_tokens": 500, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    with httpx.Client(base_url=live.url, timeout=30) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as chat:
        events = sse_events_iter(chat)
        seen = _read_until_delta(events, '"content":"')
        stopper = threading.Thread(target=live.stop)
        stopper.start()
        seen += list(events)
        stopper.join(30)
    assert seen[-1]["data"] == "[DONE]"
    assert json.loads(seen[-2]["data"])["coda"]["finish_reason"] == "cancelled"
    stats = server_settle()
    assert stats.num_free_blocks == stats.num_blocks
    assert server_engine.stats().num_running == 0
