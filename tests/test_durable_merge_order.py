"""Merge order of an n > 1 stream survives the durable log (SPEC P3; docs/api.md "Streams",
"Resume"): the first delivery of an n = 3 chat (and completions) stream from front end A is
captured byte for byte; a replay from every cut point - from the start, a comma id, a sub-id
``P.k`` - served by front end B on the same Redis, and by a front end started after A stopped
(a restart), is exactly the first delivery's bytes after that cut. Before, the log kept each
choice's events but not the interleaving, so a front end that rebuilt the stream from Redis
sent every event of choice 0, then choice 1, ... (other ids, other bytes). Real redis-server,
real uvicorn, real HTTP (httpx)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda.server.durable import ServerDurable
from tests.conftest import examples
from tests.redis_support import RedisServer, running_redis

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _frames(raw: bytes) -> list[bytes]:
    """The SSE events of a body, each with its blank line (comments: keepalives, dropped)."""
    out = []
    for block in raw.split(b"\n\n"):
        lines = [ln for ln in block.split(b"\n") if ln and not ln.startswith(b":")]
        if lines:
            out.append(b"\n".join(lines) + b"\n\n")
    return out


def _id(frame: bytes) -> str | None:
    for line in frame.split(b"\n"):
        if line.startswith(b"id: "):
            return line[4:].decode()
    return None


def _stream(client: httpx.Client, url: str, body: dict[str, Any]) -> bytes:
    with client.stream("POST", url, json=body) as resp:
        assert resp.status_code == 200
        return b"".join(resp.iter_raw())


def _replay(client: httpx.Client, url: str, rid: str, cut: str | None) -> bytes:
    headers = {} if cut is None else {"Last-Event-ID": cut}
    resp = client.get(f"{url}/v1/streams/{rid}", headers=headers)
    assert resp.status_code == 200, resp.text
    return resp.content


def _expected(frames: list[bytes], cut: str | None) -> bytes:
    """The first delivery's bytes after the first frame whose id is ``cut`` (None: all)."""
    if cut is None:
        return b"".join(frames)
    j = next(k for k, f in enumerate(frames) if _id(f) == cut)
    return b"".join(frames[j + 1:])


_BODIES = {
    "chat": ("/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hello"}]}),
    "completions": ("/v1/completions", {"prompt": "hello"}),
}


@pytest.mark.parametrize("route", sorted(_BODIES))
def test_p3_n3_replay_from_every_cut_on_another_front_end_and_after_a_restart_is_the_first_delivery(
        route: str, server_spawn: Any, redis_server: RedisServer, server_settle: Any) -> None:
    """P3: an n = 3 stream (include_usage: its footer has a sub-id ``P.k``) delivered by A;
    from the start and after every id A sent (comma ids, the sub-id, the terminal's), B's
    replay and a restarted front end's are A's bytes after that id; a property over cut
    points checks the same on both with frames from any position."""
    a = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    b = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    path, extra = _BODIES[route]
    body = {"model": "tiny-chat", "n": 3, "stream": True, "max_tokens": 10, "ignore_eos": True,
            "seed": 5, "stream_options": {"include_usage": True}, **extra}
    with httpx.Client(timeout=60) as client:
        first = _stream(client, a.url + path, body)
        frames = _frames(first)
        ids = [i for f in frames if (i := _id(f)) is not None]
        assert len(ids) == len(frames) and all(i.count(",") == 2 for i in ids)
        assert any("." in i for i in ids)  # NOTE: the footer's usage chunk: a sub-id
        rid = next(ln for ln in frames[0].split(b"\n") if ln.startswith(b"data: "))
        rid_s = rid.split(b'"id":"', 1)[1].split(b'"', 1)[0].decode()
        # NOTE: three choices stepping together interleave (choice 0's events, then 1's, ...
        # would change choice twice): the order the log must keep
        order = [c["index"] for f in frames if f.startswith(b"id: ") and b'"choices":[{' in f
                 for c in json.loads(f.split(b"data: ", 1)[1])["choices"]]
        assert sum(x != y for x, y in zip(order, order[1:], strict=False)) > 3
        server_settle()
        cuts: list[str | None] = [None, *dict.fromkeys(ids)]
        for cut in cuts:
            assert _replay(client, b.url, rid_s, cut) == _expected(frames, cut), cut
        a.stop()  # NOTE: a restart: nothing of A's memory is left to replay from
        c = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
        for cut in cuts:
            assert _replay(client, c.url, rid_s, cut) == _expected(frames, cut), cut

        @settings(max_examples=examples(20), deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(j=st.integers(-1, len(frames) - 1), on_c=st.booleans())
        def replay_from(j: int, on_c: bool) -> None:
            cut = None if j < 0 else ids[j]
            url = c.url if on_c else b.url
            assert _replay(client, url, rid_s, cut) == _expected(frames, cut)

        replay_from()


def _choices(raw: bytes) -> dict[int, list[str]]:
    """Each choice's chunks of an SSE body, in order (what a log without merge keys keeps)."""
    out: dict[int, list[str]] = {}
    for f in _frames(raw):
        data = f.split(b"data: ", 1)[1].strip()
        if data != b"[DONE]":
            for c in json.loads(data)["choices"]:
                out.setdefault(c["index"], []).append(json.dumps(c, sort_keys=True))
    return out


def test_p3_a_log_written_without_merge_keys_still_replays_each_choice(
        server_spawn: Any, redis_server: RedisServer, server_settle: Any) -> None:
    """P3, backward compatibility: a log whose entries have no merge key (``m``, as a server
    before it wrote them) replays on another front end as before: every choice's events,
    ids and bytes, interleaved as read."""
    a = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    body = {"model": "tiny-chat", "n": 3, "stream": True, "max_tokens": 6, "ignore_eos": True,
            "seed": 7, "messages": [{"role": "user", "content": "hello"}]}
    with httpx.Client(timeout=60) as client:
        first = _stream(client, a.url + "/v1/chat/completions", body)
        rid = json.loads(_frames(first)[0].split(b"data: ", 1)[1])["id"]
        server_settle()
        r = redis_server.client
        for key in r.scan_iter(match="coda:log:*"):
            entries = r.xrange(key)
            assert entries and all(b"m" in fields for _, fields in entries)
            r.delete(key)
            for entry_id, fields in entries:
                r.xadd(key, {k: v for k, v in fields.items() if k != b"m"}, id=entry_id)
        b = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
        replay = _replay(client, b.url, rid, None)
    assert _choices(replay) == _choices(first)


def test_p3_n3_resume_of_a_running_stream_on_another_front_end_keeps_the_merge_order(
        server_spawn: Any, redis_server: RedisServer, server_settle: Any) -> None:
    """P3: a client reads a few frames of a running n = 3 stream from A and leaves
    (``on_disconnect: continue``); its resume on B follows the log live, yet sends exactly
    A's bytes after its cut (A's own full replay is the first delivery's order): B waits to
    send an event until every running choice's log is past its merge key."""
    a = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    b = server_spawn(durable=ServerDurable(redis_server.url, lease_ttl_s=2))
    body = {"model": "tiny-chat", "n": 3, "stream": True, "max_tokens": 200, "ignore_eos": True,
            "seed": 9, "messages": [{"role": "user", "content": "hello"}],
            "on_disconnect": "continue"}
    with httpx.Client(timeout=60) as client:
        head: list[bytes] = []
        with client.stream("POST", a.url + "/v1/chat/completions", json=body) as resp:
            block: list[str] = []
            for line in resp.iter_lines():
                if line:
                    block.append(line)
                elif block:
                    head.append(("\n".join(block) + "\n\n").encode())
                    block = []
                    if len(head) >= 5:
                        break
        rid = json.loads(head[0].split(b"data: ", 1)[1])["id"]
        cut = _id(head[-1])
        assert cut is not None
        tail = _replay(client, b.url, rid, cut)
        server_settle()
        full = _replay(client, a.url, rid, None)
    assert _frames(full)[:5] == head
    assert tail == _expected(_frames(full), cut)
