"""The durable stream log behind the HTTP server (issue 12 items 2, 3, 5; SPEC P3, P4, L2, L5,
L6): a stream resumes through a second ingress with ``Last-Event-ID``; a background response
survives a SIGKILL of its server and is resumed from a restarted one on the same Redis, ended
exactly once with ``model_error`` and its committed tokens billed. Real redis-server, real
uvicorn, real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from coda.server.durable import ServerDurable
from tests.redis_support import RedisServer, running_redis
from tests.scaleout_support import sse_events

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _chat_text(events: list[dict[str, str]]) -> str:
    text = ""
    for ev in events:
        if ev["data"] != "[DONE]":
            for c in json.loads(ev["data"])["choices"]:
                text += c["delta"].get("content") or ""
    return text


def test_resume_through_a_second_ingress_p3_p4(server_spawn: Any, redis_server: RedisServer,
                                               server_settle: Any) -> None:
    """P3: a client that lost ingress A resumes on ingress B with Last-Event-ID and gets every
    remaining event exactly once; A's full replay is the oracle."""
    a = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    b = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hello"}],
            "stream": True, "max_tokens": 40, "ignore_eos": True, "seed": 3,
            "on_disconnect": "continue"}
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{a.url}/v1/chat/completions", json=body) as resp:
            head = sse_events(resp, stop_after=4)
        rid = json.loads(head[0]["data"])["id"]
        last_id = head[-1]["id"]
        with client.stream("GET", f"{b.url}/v1/streams/{rid}",
                           headers={"Last-Event-ID": last_id}) as resp:
            assert resp.status_code == 200
            tail = sse_events(resp)
        with client.stream("GET", f"{a.url}/v1/streams/{rid}") as resp:
            full = sse_events(resp)
    assert tail[-1]["data"] == "[DONE]" and full[-1]["data"] == "[DONE]"
    # NOTE: ids order as (position, frames of the next group held): "40" < "40.1" < "41"
    def key(fid: str) -> tuple[int, ...]:
        return tuple(int(x) for x in fid.split("."))

    ids = [key(e["id"]) for e in tail if "id" in e]
    assert ids == sorted(ids) and ids[0] > key(last_id)
    assert _chat_text(head) + _chat_text(tail) == _chat_text(full)
    finals = [c for e in tail[:-1] for c in json.loads(e["data"])["choices"]
              if c.get("finish_reason")]
    assert [c["finish_reason"] for c in finals] == ["length"]
    server_settle()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_background_response_survives_a_sigkill_l2_l5_l6(
        server_spawn: Any, server_checkpoint: Path, redis_server: RedisServer) -> None:
    """L2/L5/L6: SIGKILL the server mid-response; a server restarted on the same Redis ends the
    orphan exactly once (model_error, the committed tokens billed) and replays it from 0."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coda.cli", "serve", "--model", str(server_checkpoint),
         "--port", str(port), "--redis-url", redis_server.url, "--lease-ttl-s", "1",
         "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=60) as client:
            deadline = time.monotonic() + 90
            while True:
                try:
                    if client.get(f"{url}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
            created = client.post(f"{url}/v1/responses", json={
                "model": "tiny-chat", "input": "hi", "background": True,
                "max_output_tokens": 480, "ignore_eos": True, "seed": 5}).json()
            rid = created["id"]
            with client.stream("GET", f"{url}/v1/responses/{rid}?stream=true") as resp:
                # NOTE: through the third text delta (queued: 1): the client read three deltas
                # from the durable copy, so at least three tokens are committed at the kill
                first = sse_events(resp, stop_after=8)
            assert [e["event"] for e in first[-3:]] == ["response.output_text.delta"] * 3
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            seen = int(first[-1]["id"])
            restarted = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=0.6))
            with client.stream("GET", f"{restarted.url}/v1/responses/{rid}",
                               params={"stream": "true", "starting_after": seen}) as resp:
                assert resp.status_code == 200
                rest = sse_events(resp)
            with client.stream("GET", f"{restarted.url}/v1/responses/{rid}",
                               params={"stream": "true"}) as resp:
                replay = sse_events(resp)
            final = client.get(f"{restarted.url}/v1/responses/{rid}").json()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    nums = [int(e["id"]) for e in replay]
    assert nums == list(range(len(replay)))  # replayable from sequence 0, no gap, no repeat
    assert [e["data"] for e in replay[seen + 1:]] == [e["data"] for e in rest]
    kinds = [e["event"] for e in replay]
    assert kinds[-1] == "response.failed" and kinds.count("response.failed") == 1
    assert sum(k in ("response.completed", "response.incomplete") for k in kinds) == 0
    deltas = [json.loads(e["data"])["delta"] for e in replay
              if e["event"] == "response.output_text.delta"]
    assert final["status"] == "failed" and final["output"][0]["content"][0]["text"] == "".join(
        deltas)
    # NOTE: one token per delta on this ASCII tokenizer: billed == committed, at least what the
    # client saw before the kill, < 480
    assert 3 <= final["usage"]["output_tokens"] == len(deltas) < 480
    from coda.durable.redis_log import RedisStreamLog
    from tests.scaleout_support import FaultRow

    row = FaultRow("single server SIGKILLed mid background response, restarted")
    row.add_log(RedisStreamLog(redis_server.url).read(rid))
    row.report()


def test_issue22_routes_store_the_engines_own_handles_reading_the_durable_copy_p3(
        server_spawn: Any, redis_server: RedisServer, server_settle: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 22 step 3 (P3, seed 004): with ``durable`` the app's engine is the durable
    wrapper and its store the Redis one, both chosen when the app is built; a route stores
    exactly the handles the engine returned (nothing swaps them at store time), and each
    reads the durable copy: after the request its events are the log's, seq for seq. The
    record is in the log too, linked to its requests."""
    from coda.durable.engine import DurableEngine
    from coda.durable.redis_log import RedisStreamLog
    from coda.server.durable import RedisResponseStore
    from coda.server.state import ServerState

    submitted: list[Any] = []
    real = ServerState.submit_all

    def spy(self: ServerState, requests: Any, *args: Any) -> Any:
        handles = real(self, requests, *args)
        submitted.extend(handles)
        return handles

    monkeypatch.setattr(ServerState, "submit_all", spy)
    live = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    st = live.app.state.coda
    assert isinstance(st.engine, DurableEngine) and isinstance(st.store, RedisResponseStore)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "n": 2,
            "max_tokens": 6, "ignore_eos": True, "seed": 4}
    with httpx.Client(timeout=60) as client:
        rid = client.post(f"{live.url}/v1/chat/completions", json=body).json()["id"]
    record = st.store.get(rid)
    assert len(record.handles) == 2 and all(
        h is s for h, s in zip(record.handles, submitted, strict=True))
    log = RedisStreamLog(redis_server.url)
    for h in record.handles:
        durable = [(e.seq, e.type, e.data) for e in log.read(h.request_id)]
        assert [(e.seq, e.type, e.data) for e in h.stream.events_after(-1)] == durable
        assert durable[-1][1].value == "terminal"
    assert log.get_record(rid)["handles"] == [h.request_id for h in record.handles]
    server_settle()
