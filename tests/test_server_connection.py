"""A client that stalls (stops reading) and then leaves, or never reads again, is noticed
(issue 14 item 1; SPEC P4, L5, L7, P6), through raw sockets against the live server.

The recipe of the issue: a raw socket with ``SO_RCVBUF=1024`` sends a streamed chat request
whose frames are large (``top_logprobs`` 20), reads the first bytes, stops reading so the
server's write blocks, then closes. The request must end ``transport_error`` (never run on to
its limit, never resume generating), with its resources released.
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httpx
import pytest

from coda.server.state import ServerSettings
from tests.conftest import SSEAccumulator

MODEL = "tiny-chat"


def _stalling_client(port: int, body: dict[str, Any]) -> tuple[socket.socket, str]:
    """Send ``body`` as a streamed chat request on a socket with a tiny receive buffer; read
    only the response head; return the socket and the request id."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
              b"application/json\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(256)
        assert chunk, "server closed before the response head"
        head += chunk
    rid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
               if line.lower().startswith(b"x-request-id:"))
    return s, rid


def _body(policy: str, max_tokens: int = 480, **extra: Any) -> dict[str, Any]:
    # NOTE: "pause" counts text bytes (one a token here), so its default 64 KiB would never
    # pause these 480 tokens: a small bound makes the stalled stream really pause, instead of
    # racing the client's close to its last token.
    bound = {"pause_bytes": 64} if policy == "pause" else {}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": max_tokens, "ignore_eos": True, "logprobs": True, "top_logprobs": 20,
            "stream": True, "backpressure": {"policy": policy, **bound}, **extra}


def _final_coda(url: str, rid: str, timeout: float = 30.0) -> dict[str, Any]:
    """The replayed final chunk's ``coda`` object (waits for the request to end)."""
    acc = SSEAccumulator()
    final: dict[str, Any] = {}
    with httpx.stream("GET", f"{url}/v1/streams/{rid}", timeout=timeout) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            ev = acc.feed(line)
            if ev and ev.get("data", "[DONE]") != "[DONE]":
                chunk = json.loads(ev["data"])
                if "coda" in chunk:
                    final = chunk["coda"]
    return final


def _wait_idle(url: str, timeout: float = 20.0) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        health = httpx.get(url + "/health").json()
        if health["num_running"] == 0 or time.monotonic() > end:
            return health  # type: ignore[no-any-return]
        time.sleep(0.05)


@pytest.mark.parametrize("policy", ["buffer", "pause"])
def test_p4_l5_l7_stalled_then_closed_client_ends_transport_error(
        server_spawn: Any, server_settle: Any, policy: str) -> None:
    """P4/L5/L7: the issue's recipe, three times per backpressure policy: the stalled client's
    close is noticed while the server's write is blocked; the request ends CANCELLED /
    transport_error long before its 480 tokens, /health stops counting it, and every KV block
    is free again."""
    live = server_spawn(settings=ServerSettings(keepalive_s=0.5, write_timeout_s=60.0))
    for _ in range(3):
        s, rid = _stalling_client(live.port, _body(policy, n=8))
        time.sleep(1.5)
        s.close()
        assert _wait_idle(live.url)["num_running"] == 0
        coda = _final_coda(live.url, rid)
        assert coda["finish_reason"] == "transport_error" and coda["state"] == "CANCELLED"
        assert coda["usage"]["selected_tokens"] < 480
    stats = server_settle()
    assert stats.num_free_blocks == stats.num_blocks


def test_p4_p6_client_that_stops_reading_is_cut_after_the_write_bound(
        server_spawn: Any, server_settle: Any) -> None:
    """P4/P6/L7: a client that stops reading and never closes: one write may block at most
    ``write_timeout_s`` (here 1 s); then the client counts as gone and the request ends
    transport_error (default policy ``cancel``), instead of being held forever."""
    live = server_spawn(settings=ServerSettings(keepalive_s=0.5, write_timeout_s=1.0))
    s, rid = _stalling_client(live.port, _body("buffer", n=8))
    try:
        t0 = time.monotonic()
        coda = _final_coda(live.url, rid)
        assert coda["finish_reason"] == "transport_error"
        assert coda["usage"]["selected_tokens"] < 480
        assert time.monotonic() - t0 < 15
    finally:
        s.close()
    stats = server_settle()
    assert stats.num_free_blocks == stats.num_blocks


def test_p4_on_disconnect_continue_keeps_generating_after_a_stall(
        server_spawn: Any, server_settle: Any) -> None:
    """P4: under ``on_disconnect: "continue"`` the stalled-then-closed client's request runs
    to its own end (here max_output_tokens) and stays replayable; nothing is cancelled."""
    live = server_spawn(settings=ServerSettings(keepalive_s=0.5, write_timeout_s=1.0))
    s, rid = _stalling_client(live.port, _body("buffer", max_tokens=200,
                                               on_disconnect="continue"))
    time.sleep(1.0)
    s.close()
    coda = _final_coda(live.url, rid)
    assert coda["finish_reason"] == "max_output_tokens" and coda["state"] == "FINISHED"
    assert coda["usage"]["selected_tokens"] == 200
    server_settle()


def test_p5_every_write_counts_its_send_time_on_uvloop() -> None:
    """P5: ``network_send_s`` sums the time spent inside writes. Under uvicorn's loop (uvloop)
    a sub-millisecond write counts too: uvloop's ``loop.time()`` is the iteration's cached
    millisecond, so timing writes with it read 0.0 for a whole fast stream (an ``n = 2`` chat's
    terminals both reported a send of 0.0)."""
    import asyncio

    uvloop = pytest.importorskip("uvloop")
    from coda.server.connection import Connection

    async def send(_message: Any) -> None:
        t = time.perf_counter()
        while time.perf_counter() - t < 2e-4:  # NOTE: a 0.2 ms write, within one iteration
            pass

    async def receive() -> Any:
        await asyncio.sleep(3600)

    async def main() -> list[float]:
        conn = Connection(receive, send, write_timeout_s=5.0)
        seen = []
        for _ in range(20):
            before = conn.send_s
            await conn.write(b"x")
            seen.append(conn.send_s - before)
        return seen

    seen = uvloop.run(main())
    assert all(s >= 2e-4 for s in seen), seen


def _asgi_pair() -> tuple[Any, Any, list[dict[str, Any]]]:
    """An ASGI ``receive``/``send`` pair that behaves as uvicorn's and httpx's: ``receive``
    answers ``http.disconnect`` once the response's last message was sent."""
    import asyncio

    sent: list[dict[str, Any]] = []
    complete = asyncio.Event()

    async def send(message: Any) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            complete.set()

    async def receive() -> Any:
        await complete.wait()
        return {"type": "http.disconnect"}

    return receive, send, sent


def test_p4_the_last_write_completes_the_exchange_not_a_lost_client() -> None:
    """P4 (issue 22: no exception per finished stream): the ASGI server reports
    ``http.disconnect`` as soon as the response's last message is sent, and the watch may see
    it before the write resumes; that is the exchange's end, so the last write returns (no
    :class:`ClientGone` raised, nothing for the disconnect policy)."""
    import asyncio

    from coda.server.connection import Connection

    async def main() -> list[dict[str, Any]]:
        receive, send, sent = _asgi_pair()
        conn = Connection(receive, send, write_timeout_s=5.0)
        watch = asyncio.ensure_future(conn.watch())
        await conn.start(200, [])
        await conn.write(b"data: 1\n\n")
        await conn.write(b"data: [DONE]\n\n", more_body=False)  # NOTE: must not raise
        await asyncio.wait_for(watch, 5.0)  # NOTE: the watch saw the exchange's end
        return sent

    sent = asyncio.run(main())
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n"]


def test_p4_a_client_gone_before_the_last_write_is_still_lost() -> None:
    """P4: the last write to a client that already left raises :class:`ClientGone` (the
    exchange did not complete), as every other write does."""
    import asyncio

    from coda.server.connection import ClientGone, Connection

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    async def send(_message: Any) -> None:
        return None

    async def main() -> None:
        conn = Connection(receive, send, write_timeout_s=5.0)
        await conn.watch()
        with pytest.raises(ClientGone):
            await conn.write(b"data: [DONE]\n\n", more_body=False)

    asyncio.run(main())
