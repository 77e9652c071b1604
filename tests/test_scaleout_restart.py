"""Restart-and-resume with replicas (issue 12 items 3, 5; SPEC L2, L5, L6, P2, P3): a whole
``coda serve --replicas 2 --redis-url`` server — the ingress, its local Ray and both replicas
— is SIGKILLed mid-stream, and two servers start at once on the same Redis. Every request whose
log had no terminal gets exactly one (``model_error``, the durable tokens billed), written by
one of the two; each stays replayable from sequence 0 and resumable after what the client saw.
One Ray start (inside the killed server) for the module."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")

from coda.durable.redis_log import RedisStreamLog  # noqa: E402
from coda.finish import FinishReason  # noqa: E402
from coda.lifecycle import State  # noqa: E402
from coda.server.durable import ServerDurable  # noqa: E402
from coda.stream import EventType  # noqa: E402
from tests.conftest import SSEAccumulator  # noqa: E402
from tests.redis_support import RedisServer, running_redis  # noqa: E402
from tests.scaleout_support import FaultRow, kill_session, session_pids  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _events(resp: httpx.Response, stop_after: int | None = None,
            lines: Iterator[str] | None = None) -> list[dict[str, str]]:
    """SSE events of ``resp``; ``lines``: an iterator over its lines that the caller keeps
    (an abandoned iterator closes the connection: a client that left)."""
    acc, out = SSEAccumulator(), []
    for line in lines if lines is not None else resp.iter_lines():
        ev = acc.feed(line)
        if ev is not None:
            out.append(ev)
            if stop_after is not None and len(out) >= stop_after:
                break
    return out


def _start(server_checkpoint: Path, url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coda.cli", "serve", "--model", str(server_checkpoint),
         "--port", str(port), "--replicas", "2", "--redis-url", url, "--lease-ttl-s", "2",
         "--max-num-seqs", "4", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    with httpx.Client(timeout=10) as client:
        while True:
            if proc.poll() is not None:
                raise AssertionError((proc.stderr.read() if proc.stderr else b"")[-3000:])
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the replica server did not start"
            time.sleep(0.5)


def test_whole_server_sigkilled_two_restarts_end_each_orphan_once_l2_l5_l6(
        server_checkpoint: Path, redis_server: RedisServer, server_spawn: Any) -> None:
    """A cancel-policy chat, a continue-policy chat and a background response run on the
    replicas when the whole server is SIGKILLed. Two servers then start at once on the same
    Redis: each orphan (a request whose log has no terminal) ends exactly once (model_error,
    usage = the durable deltas' tokens, the reapers' counts add up to the orphans); every
    request replays from 0 without gap and resumes after the client's last event on either
    server."""
    proc, url = _start(server_checkpoint, redis_server.url)
    chat = {"model": "tiny-chat", "stream": True, "ignore_eos": True, "max_tokens": 480}
    held = contextlib.ExitStack()
    try:
        with httpx.Client(timeout=60) as client, held:
            heads: dict[str, list[dict[str, str]]] = {}
            chats = []
            for policy in ("cancel", "continue"):
                # NOTE: held open until the kill: the cancel-policy client is still there
                resp = held.enter_context(client.stream("POST", f"{url}/v1/chat/completions",
                                                        json={**chat, "seed": 6,
                                                              "messages": [{"role": "user",
                                                                            "content": policy}],
                                                              "on_disconnect": policy}))
                rid = resp.headers["x-request-id"]
                lines = resp.iter_lines()
                held.callback(lines.close)  # type: ignore[attr-defined]
                heads[rid] = _events(resp, stop_after=3, lines=lines)
                chats.append(rid)
            bg = client.post(f"{url}/v1/responses", json={
                "model": "tiny-chat", "input": "hi", "background": True,
                "max_output_tokens": 480, "ignore_eos": True, "seed": 5}).json()["id"]
            with client.stream("GET", f"{url}/v1/responses/{bg}?stream=true") as resp:
                heads[bg] = _events(resp, stop_after=6)
            killed = kill_session(proc.pid)
    finally:
        killed = max(locals().get("killed", 0), kill_session(proc.pid))
        proc.wait(10)
    assert killed >= 4  # the ingress, Ray's daemons and the two replica workers
    deadline = time.monotonic() + 30
    while session_pids(proc.pid):
        assert time.monotonic() < deadline, "processes of the killed server survive"
        time.sleep(0.2)
    dlog = RedisStreamLog(redis_server.url)
    ids = [bg, *chats]
    # NOTE: the tiny model is fast: a request may have finished before the kill; the others
    # are the orphans (the one started last, the background response, practically always)
    orphans = [r for r in ids if "term" not in dlog.meta(r)]
    assert orphans
    durables = [ServerDurable(redis_server.url, lease_ttl_s=1) for _ in range(2)]
    servers = [server_spawn(durable=d) for d in durables]  # NOTE: both reap at start
    deadline = time.monotonic() + 60
    while not all("term" in dlog.meta(r) for r in ids):
        assert time.monotonic() < deadline, "an orphan was not ended"
        time.sleep(0.1)
    row = FaultRow("whole server SIGKILLed (ingress + Ray + replicas), two restarts")
    with httpx.Client(timeout=60) as client:
        for k, rid in enumerate(ids):
            evs = dlog.read(rid)
            assert [e.seq for e in evs] == list(range(len(evs)))
            term = evs[-1].terminal
            committed = sum(len(e.tokens) for e in evs if e.type is EventType.DELTA)
            assert term is not None and term.usage.selected_tokens == committed >= 1
            if rid in orphans:
                assert term.state is State.FAILED
                assert term.finish_reason is FinishReason.MODEL_ERROR
            row.add_log(evs)
            base = servers[k % 2].url
            seen = int(heads[rid][-1]["id"])
            if rid == bg:
                with client.stream("GET", f"{base}/v1/responses/{rid}",
                                   params={"stream": "true"}) as resp:
                    replay = _events(resp)
                with client.stream("GET", f"{base}/v1/responses/{rid}",
                                   params={"stream": "true", "starting_after": seen}) as resp:
                    rest = _events(resp)
                assert [int(e["id"]) for e in replay] == list(range(len(replay)))
                assert [e["data"] for e in replay[seen + 1:]] == [e["data"] for e in rest]
                ends = ("response.completed", "response.incomplete", "response.failed")
                assert sum(e["event"] in ends for e in replay) == 1
                final = client.get(f"{base}/v1/responses/{rid}").json()
                assert final["usage"]["output_tokens"] == committed
            else:
                with client.stream("GET", f"{base}/v1/streams/{rid}",
                                   headers={"Last-Event-ID": str(seen)}) as resp:
                    tail = _events(resp)
                got = {int(e["id"]) for e in heads[rid] + tail if "id" in e}
                assert got == set(range(len(evs)))  # every event id once, head + tail
                bodies = [json.loads(e["data"]) for e in tail if e["data"] != "[DONE]"]
                errors = [b["error"] for b in bodies if "error" in b]
                assert [e["code"] for e in errors] == (["model_error"] if rid in orphans
                                                        else [])
                assert tail[-1]["data"] == "[DONE]"
    assert sum(d.log.reaped_total for d in durables) == len(orphans)
    row.report()
