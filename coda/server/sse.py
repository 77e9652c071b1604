"""Server-sent events over the engine's sequence-numbered streams (SPEC P2, P3, P4, P5, P6).

:class:`EventSource` reads one or more :class:`~coda.stream.RequestStream` logs from any
position (replay + live, P3) and acknowledges what reached the socket (backpressure credit,
P6). :class:`SSEResponse` is a raw ASGI response that pumps a :class:`Renderer`'s frames,
writes a keepalive comment whenever the request is quiet (queued, prefilling), and watches
the connection concurrently: a disconnect is reported to ``on_disconnect`` as a transport
event (P4) — it never ends the stream as if the model had finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from coda.stream import EventType, RequestStream, StreamEvent

log = logging.getLogger("coda.server")

# NOTE: no blank line after the comment: a blank line dispatches an event, and SDK decoders
# that keep the last event id (openai, anthropic) would then yield an empty-data event.
KEEPALIVE = b": keepalive\n"


@dataclass(frozen=True)
class Frame:
    """One SSE event; ``data`` is a JSON-ready object or a literal string (``[DONE]``)."""

    data: Any
    event: str | None = None
    id: str | None = None

    def encode(self) -> bytes:
        lines = []
        if self.id is not None:
            lines.append(f"id: {self.id}")
        if self.event is not None:
            lines.append(f"event: {self.event}")
        body = self.data if isinstance(self.data, str) else json.dumps(
            self.data, ensure_ascii=False, separators=(",", ":"))
        lines.append(f"data: {body}")
        return ("\n".join(lines) + "\n\n").encode()


class Renderer:
    """Turns engine events into protocol frames. ``after`` holds, per stream, the engine
    sequence number to resume after (``-1``: from the start)."""

    def __init__(self, n: int, after: Sequence[int] | None = None) -> None:
        self.after = list(after) if after is not None else [-1] * n
        self.network_send_s = 0.0  # NOTE: updated by the pump (P5 "network send")

    def header(self) -> list[Frame]:
        return []

    def on_event(self, index: int, ev: StreamEvent, positions: list[int]) -> list[Frame]:
        raise NotImplementedError

    def footer(self) -> list[Frame]:
        return []


def position_id(positions: Sequence[int]) -> str:
    """SSE id of a merged stream: each request's last engine seq, comma separated (n=1: the
    seq itself), so ``Last-Event-ID`` resumes every choice where it stopped (P3)."""
    return ",".join(str(p) for p in positions)


def parse_position_id(value: str | None, n: int) -> list[int] | None:
    if value is None or not value.strip():
        return None
    try:
        parts = [int(p) for p in value.split(",")]
    except ValueError:
        return None
    return parts if len(parts) == n and all(p >= -1 for p in parts) else None


class EventSource:
    """Replay-then-follow reader over ``streams`` on the running event loop (P3)."""

    def __init__(self, streams: Sequence[RequestStream], after: Sequence[int]) -> None:
        self._streams = list(streams)
        self.positions = list(after)
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._removers = [s.add_listener(self._notify) for s in self._streams]

    def _notify(self) -> None:  # NOTE: called on the engine thread
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._wake.set)

    def _done(self) -> bool:
        return all(s.closed and p >= s.last_seq for s, p in zip(self._streams, self.positions,
                                                                    strict=True))

    async def next(self, timeout: float) -> list[tuple[int, StreamEvent]] | None:
        """The next events in log order; ``[]`` after ``timeout`` quiet seconds; None at the end."""
        while True:
            self._wake.clear()  # NOTE: clear before reading, so no append is missed
            batch: list[tuple[int, StreamEvent]] = []
            for i, stream in enumerate(self._streams):
                for ev in stream.events_after(self.positions[i]):
                    batch.append((i, ev))
            if batch:
                return batch
            if self._done():
                return None
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return []

    def ack(self) -> None:
        for stream, pos in zip(self._streams, self.positions, strict=True):
            if pos >= 0:
                stream.ack(pos)

    def close(self) -> None:
        for remove in self._removers:
            remove()


class SSEResponse(Response):
    """Streams ``renderer`` frames for ``streams``; see the module docstring."""

    media_type = "text/event-stream"

    def __init__(self, streams: Sequence[RequestStream], renderer: Renderer, *,
                 keepalive_s: float, on_disconnect: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self._streams = streams
        self._renderer = renderer
        self._keepalive_s = keepalive_s
        self._on_disconnect = on_disconnect
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no",
                           "content-type": "text/event-stream; charset=utf-8", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                if not task.done():
                    task.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
        broken = pump.cancelled() or pump.exception() is not None
        if not pump.cancelled() and not isinstance(pump.exception(), OSError | type(None)):
            log.error("SSE pump failed", exc_info=pump.exception())
        if broken and self._on_disconnect is not None:
            # NOTE: P4: a lost client is a transport event, handled by the declared policy.
            self._on_disconnect()

    async def _send(self, send: Send, body: bytes) -> None:
        t0 = time.perf_counter()
        await send({"type": "http.response.body", "body": body, "more_body": True})
        self._renderer.network_send_s += time.perf_counter() - t0

    async def _pump(self, send: Send) -> None:
        r = self._renderer
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        source = EventSource(self._streams, r.after)
        try:
            head = r.header()
            if head:
                await self._send(send, b"".join(f.encode() for f in head))
            while True:
                batch = await source.next(self._keepalive_s)
                if batch is None:
                    break
                if not batch:
                    await self._send(send, KEEPALIVE)
                    continue
                frames: list[Frame] = []
                for index, ev in batch:
                    source.positions[index] = ev.seq
                    frames.extend(r.on_event(index, ev, list(source.positions)))
                if frames:
                    # NOTE: one write per batch: a frame group reaches the client whole or not.
                    await self._send(send, b"".join(f.encode() for f in frames))
                source.ack()
            tail = r.footer()
            await send({"type": "http.response.body",
                        "body": b"".join(f.encode() for f in tail), "more_body": False})
        finally:
            source.close()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def is_terminal(ev: StreamEvent) -> bool:
    return ev.type is EventType.TERMINAL
