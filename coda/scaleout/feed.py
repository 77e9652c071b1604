"""The replica → ingress event transport: one streaming call per (replica, ingress) carrying
batches of every request's events (issue 12 items 1, 6; SPEC P1, P3, P6).

Why not one streaming call per request: every item of a Ray Serve streaming call costs about a
millisecond of CPU between the two processes (gRPC, the core worker, Serve's wrappers), and a
decoding engine appends one delta per running request per step — so per-request calls paid
that millisecond per token. Here a replica's engine appends, the wake-up channel
(:mod:`coda.wakeup`) wakes the :class:`Outbox` of each ingress on the replica's event loop
(one dispatch per batch of appends), and that ingress's one ``feed``
call yields everything accumulated since its last item: one item per replica per wake-up,
whatever the batch size. An item is the compact binary form of :mod:`coda.durable.codec`
(bytes pass through Ray without pickling dataclasses).

Per request the order is the stream's (events are taken with ``events_after`` under the
outbox lock, so each seq is forwarded once, in order); a stream is acknowledged (P6 credit)
once its events were handed to Ray. :class:`FeedClient` is the ingress half: it routes each
request's events to an async iterator (:meth:`FeedClient.events`), and when the feed call
fails (the replica died) every request routed to it sees the error — the caller decides,
per request, between a resubmit and a ``model_error`` terminal (``RemoteEngine._pump``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from coda.durable.codec import decode_batch, encode_batch
from coda.stream import EventType, RequestStream, StreamEvent
from coda.wakeup import CHANNEL

log = logging.getLogger("coda.scaleout")


class Outbox:
    """The replica side of one ingress's feed: events waiting to be yielded, filled and
    drained on the replica's event loop.

    Messages follow the producer's steps (issue 24 item 2). A stream is forwarded with its
    step source (:meth:`forward`): the replica's engine for its own streams (an engine appends
    one delta per running request at the end of each step), the log's mirror for durable
    copies (it appends a flush's events to every copy in one burst). The source has a
    ``stepping`` flag and posts the end of each step on the wake-up channel with itself as the
    source; an append observed while a step runs waits for that step's end, so one message
    carries the step's events of every request (the replica's loop may otherwise wake at the
    first append of the burst and send the rest in a second message). An append observed
    while no step runs (a start at submit, a cancel while idle) is sent at once. So every
    event is sent by the end of the step running when it was observed, never later."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[RequestStream, list[StreamEvent]]] = []
        self._wake = asyncio.Event()
        self.closed = False
        self.messages = 0  # NOTE: yielded (a benchmark's counter)
        self._sources: dict[int, Callable[[], None]] = {}  # NOTE: id(step source) -> remover

    def _step_ended(self, _step: int) -> None:  # NOTE: on the replica's loop (the channel)
        # NOTE: checked after the rest of this dispatch: a dispatch that comes late calls the
        # source's (older) entry first, then the appends of the step that just ended
        self._loop.call_soon(self._wake_if_pending)

    def _wake_if_pending(self) -> None:
        if self._pending:
            self._wake.set()

    def forward(self, stream: RequestStream, *, start_only: bool = False,
                steps: Any = None) -> None:
        """Forward every event of ``stream`` (from seq 0) until its terminal; ``start_only``
        (fault injection, ``stall_forwarding``): the start event and nothing after it.
        ``steps``: the stream's step source (see the class; None: each wake-up is sent)."""
        pos = -1
        remover: list[Callable[[], None]] = []
        if steps is not None and id(steps) not in self._sources and not self.closed:
            self._sources[id(steps)] = CHANNEL.subscribe(steps, self._step_ended, self._loop)

        def on_append(_seq: int = -1) -> None:  # NOTE: on the replica's loop (the channel)
            nonlocal pos
            with self._lock:
                evs = stream.events_after(pos)
                if start_only:
                    evs = evs[:1] if pos < 0 else []
                if not evs or self.closed:
                    return
                pos = evs[-1].seq
                self._pending.append((stream, evs))
            if evs[-1].type is EventType.TERMINAL and remover:
                remover[0]()
            # NOTE: a step running now posts its end after its appends (see the class)
            if steps is None or not steps.stepping:
                self._wake.set()

        remover.append(stream.subscribe(on_append, self._loop))
        on_append()  # NOTE: the start event was appended before the subscription

    async def drain(self) -> AsyncIterator[bytes]:
        """Encoded batches, each acknowledged on its streams once handed over (P6)."""
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                with self._lock:
                    items, self._pending = self._pending, []
                if not items:
                    continue
                self.messages += 1
                yield encode_batch([(s.request_id, evs) for s, evs in items])
                for stream, evs in items:
                    stream.ack(evs[-1].seq)
        finally:
            with self._lock:
                self.closed = True
                self._pending = []
            for unsubscribe in self._sources.values():
                unsubscribe()
            self._sources.clear()


class FeedClient:
    """The ingress side of one replica's feed, on one event loop: a reader task dispatching
    batches to per-request queues, reconnecting after a failure."""

    def __init__(self, open_feed: Callable[[str], Any],
                 submit: Callable[..., Awaitable[Any]]) -> None:
        self._open_feed = open_feed
        self._submit = submit
        self._routes: dict[str, asyncio.Queue[list[StreamEvent] | BaseException]] = {}
        self._id = uuid.uuid4().hex
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            err: BaseException
            try:
                async for blob in self._open_feed(self._id):
                    for rid, evs in decode_batch(blob):
                        q = self._routes.get(rid)
                        if q is not None:
                            q.put_nowait(evs)
                err = RuntimeError("replica feed ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NOTE: a dead replica (RayActorError, ...)
                err = exc
            if self._routes:
                log.warning("replica feed failed; failing its %d requests", len(self._routes),
                            exc_info=err)
            # NOTE: whatever the replica still held for this feed is gone with it: every
            # request routed here ends or is resubmitted by its caller; new ones use a new feed
            routes, self._routes, self._id = self._routes, {}, uuid.uuid4().hex
            for q in routes.values():
                q.put_nowait(err)
            await asyncio.sleep(0.05)

    async def events(self, req: Any, request_id: str, *extra: Any
                     ) -> AsyncIterator[list[StreamEvent]]:
        """Submit ``req`` (``submit(req, feed_id, *extra)``) to the replica and yield its
        events, a message's worth at a time, through its terminal; raises what the submit or
        the feed raised (the replica failed)."""
        q: asyncio.Queue[list[StreamEvent] | BaseException] = asyncio.Queue()
        self._routes[request_id] = q
        try:
            await self._submit(req, self._id, *extra)
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item and item[-1].type is EventType.TERMINAL:
                    return
        finally:
            if self._routes.get(request_id) is q:
                del self._routes[request_id]

    def close(self) -> None:
        self._task.cancel()
