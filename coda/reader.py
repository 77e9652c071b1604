"""The one reader of request streams (SPEC P2, P3, P6; issue 11 item 4).

Every consumer of a :class:`~coda.stream.RequestStream` reads it through this module: the
engine's handle and ``attach`` (resume) through :func:`follow`, the SSE pump through
:class:`StreamReader` (several streams merged, with a quiet timeout), non-streaming routes
through :func:`terminal_of`, a finished log through :func:`replay` (the metrics, at each end,
:mod:`coda.server.metrics`), an observer of one request's end (the model router) through
:func:`when_closed`, a resume that names a position not logged yet through
:func:`logged_until` and blocking waits through :func:`wait_terminal`.
Reading is replay-then-follow: events after a position are taken from the log, then the reader
sleeps until the producer appends (the wake-up channel, :mod:`coda.wakeup`, wakes it on its own
event loop; nothing of a reader runs on the producer's thread), so a reader may start at any
sequence number, before or after the terminal (P3). A blocking reader without an event loop
waits on the stream itself (:func:`wait_terminal`).

Acknowledging (P6 backpressure credit) is the reader's choice: :func:`follow` acknowledges
each event once it was yielded; the SSE pump acknowledges a batch only after its frames
reached the socket (:meth:`StreamReader.ack`).

Merge order of several streams (n > 1 choices) is :func:`merge_order`: by creation time, then
stream index, then sequence number. It is a function of the logs alone, so the live reader and
a replay from any cut render the same interleaving (P3). A batch is a consistent cut: an event
created before the cut's clock reading was already appended (creation and append share the
stream's lock), so every such event is read now and later events wait for the next batch.
With the durable log (``--redis-url``) "creation" is the event's ``merge_key``: the order of
the run it was written in, kept in the log beside it; the mirror appends runs to the copies
readers read in that order, each stamped then (so the cut above still holds), and a stream
rebuilt from the log on any front end (or after a restart) carries the same keys, so it
interleaves as the first delivery did (:mod:`coda.durable.mirror`). Such a rebuilt copy
(``log_ordered``) gets each choice's runs when its own follower reads them, so the reader
sends an event only once every running choice's copy holds a later key (:func:`settled`):
a resume on another front end of a stream still running waits for a choice that is quiet
(queued, holding a stop prefix) rather than send another order than the first delivery's.
An ingress over replicas reads its choices the same way (their events come with their keys
through the replicas' feeds, :mod:`coda.scaleout.remote`), so its first delivery is that order.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Sequence

from coda.finish import Terminal
from coda.stream import EventType, RequestStream, StreamEvent


class ReaderInterrupted(Exception):
    """The consumer went away (:meth:`StreamReader.interrupt`); the reader stops at once."""


def merge_order(batch: Iterable[tuple[int, StreamEvent]]) -> list[tuple[int, StreamEvent]]:
    """``(index, event)`` pairs in the replayable merge order (merge key or ts, index, seq).

    By merge key where every event of the batch has one (a stream rebuilt from the durable
    log); otherwise by clock (a live copy stamps every event as it is appended, keyed or not:
    an ingress's copy of a replica's stream holds the replica's unkeyed events and, when the
    replica dies, its own keyed terminal). Each stream's events keep their seq order whatever
    the keys say: an event sorts at the latest position of its stream's events before it."""
    pairs = list(batch)
    by_key = all(ev.merge_key is not None for _, ev in pairs)
    last: dict[int, float] = {}
    placed: list[tuple[float, int, int, tuple[int, StreamEvent]]] = []
    for pair in sorted(pairs, key=lambda p: (p[0], p[1].seq)):
        index, ev = pair
        # NOTE: the key stays an int (nanoseconds past 2**53: a float would merge neighbours)
        at: float = ev.merge_key if by_key and ev.merge_key is not None else ev.ts
        at = max(at, last.get(index, at))
        last[index] = at
        placed.append((at, index, ev.seq, pair))
    return [p for *_, p in sorted(placed, key=lambda q: q[:3])]


def settled(batch: list[tuple[int, StreamEvent]], streams: Sequence[RequestStream],
            seen: Sequence[StreamEvent | None]) -> list[tuple[int, StreamEvent]]:
    """The pairs of ``batch`` (merge order) that no later event of ``streams`` can precede:
    with log-ordered streams (P3), those whose merge key is at or below every running
    stream's last key read (``seen``: each stream's last event before ``batch``). A log's
    keys grow with its seqs, so what a choice's log gets next sorts after what it has."""
    if not any(s.log_ordered for s in streams):
        return batch
    last = list(seen)
    for i, ev in batch:
        prev = last[i]
        if prev is None or ev.seq > prev.seq:
            last[i] = ev
    horizon: float = float("inf")
    for end in last:
        if end is None:
            horizon = float("-inf")  # NOTE: not even its start event yet
        elif end.merge_key is None:
            return batch  # NOTE: a log written without keys: merged as read, as before
        elif end.type is not EventType.TERMINAL:
            horizon = min(horizon, end.merge_key)
    return [(i, ev) for i, ev in batch if ev.merge_key is not None and ev.merge_key <= horizon]


class StreamReader:
    """Replay-then-follow reader over ``streams`` from ``after`` (per stream; -1 = from the
    start), on the running event loop. ``positions`` is where each stream was read up to."""

    def __init__(self, streams: Sequence[RequestStream], after: Sequence[int]) -> None:
        self._streams = list(streams)
        self.positions = list(after)
        self._wake = asyncio.Event()
        self._interrupted = False
        # NOTE: each stream's last event handed out (settled's horizon), None before any
        self._seen: list[StreamEvent | None] = [None] * len(self._streams)
        self._ordered = any(s.log_ordered for s in self._streams)
        # NOTE: called on this reader's loop (the channel dispatches there)
        self._removers = [s.subscribe(self._notify) for s in self._streams]

    def _notify(self, _seq: int) -> None:
        self._wake.set()

    def _done(self) -> bool:
        return all(s.closed and p >= s.last_seq
                   for s, p in zip(self._streams, self.positions, strict=True))

    def interrupt(self) -> None:
        """The consumer is gone: :meth:`next` raises :class:`ReaderInterrupted` from now on."""
        self._interrupted = True
        self._wake.set()

    async def next(self, timeout: float | None = None) -> list[tuple[int, StreamEvent]] | None:
        """The next events in merge order (positions advanced past them); ``[]`` after
        ``timeout`` quiet seconds (None: wait as long as it takes); None once every stream
        was read through its terminal; raises :class:`ReaderInterrupted` after
        :meth:`interrupt`."""
        while True:
            if self._interrupted:
                raise ReaderInterrupted()
            self._wake.clear()  # NOTE: clear before reading, so no append is missed
            cut = time.monotonic()
            batch: list[tuple[int, StreamEvent]] = []
            later = False
            for i, stream in enumerate(self._streams):
                for ev in stream.events_after(self.positions[i]):
                    if ev.ts < cut:
                        batch.append((i, ev))
                    else:
                        later = True
            ordered = merge_order(batch)
            if self._ordered:
                self._resumed_at()
                ordered = settled(ordered, self._streams, self._seen)
            if ordered:
                for i, ev in ordered:
                    self.positions[i] = ev.seq
                    self._seen[i] = ev
                return ordered
            if later:
                continue
            if self._done():
                return None
            try:
                # NOTE: not asyncio.wait_for: on 3.11 it can swallow a racing cancellation.
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            except TimeoutError:
                if self._interrupted:
                    raise ReaderInterrupted() from None
                return []

    def _resumed_at(self) -> None:
        """Take, as the last event handed out, the one at each stream's start position (a
        resume's cut: the log holds it, :func:`logged_until`)."""
        for i, stream in enumerate(self._streams):
            if self._seen[i] is None and self.positions[i] >= 0:
                at = stream.events_after(self.positions[i] - 1)[:1]
                self._seen[i] = at[0] if at else None

    def ack(self) -> None:
        """Acknowledge everything read so far (frees backpressure credit, P6)."""
        for stream, pos in zip(self._streams, self.positions, strict=True):
            if pos >= 0:
                stream.ack(pos)

    def close(self) -> None:
        for remove in self._removers:
            remove()


def replay(stream: RequestStream, after: int = -1) -> list[StreamEvent]:
    """The events of ``stream``'s log after ``after`` as they are now (no waiting, nothing
    acknowledged): for rendering what already happened (a finished request's body, a resumed
    stream's offsets, metrics at the terminal)."""
    return stream.events_after(after)


async def follow(stream: RequestStream, after: int = -1) -> AsyncGenerator[StreamEvent, None]:
    """Replay ``stream`` after ``after``, then follow it live until its terminal (P3);
    acknowledges each event once it was yielded (P6). From at or past the terminal's sequence
    number it yields nothing and returns at once."""
    reader = StreamReader([stream], [after])
    try:
        while (batch := await reader.next()) is not None:
            for _, ev in batch:
                yield ev
                stream.ack(ev.seq)
                if ev.type is EventType.TERMINAL:
                    return
    finally:
        reader.close()


async def terminal_of(stream: RequestStream) -> Terminal:
    """The stream's terminal, waiting for it if the request is still running."""
    async for _ in follow(stream, stream.last_seq - 1 if stream.closed else -1):
        pass
    terminal = stream.terminal
    assert terminal is not None
    return terminal


def when_closed(stream: RequestStream, callback: Callable[[Terminal], None],
                loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
    """Call ``callback(terminal)`` exactly once when ``stream`` closes (at once if it is
    closed), on ``loop`` (default: the running one; never the producer's thread); returns a
    remover. For observers that only need one request's end (the model router)."""
    lock = threading.Lock()
    fired = [False]
    remover: list[Callable[[], None]] = []

    def check(_seq: int = -1) -> None:
        terminal = stream.terminal
        if terminal is None:
            return
        with lock:
            if fired[0]:
                return
            fired[0] = True
        if remover:
            remover[0]()
        callback(terminal)

    remover.append(stream.subscribe(check, loop))
    check()  # NOTE: the stream may have closed before the subscription
    return remover[0]


def wait_terminal(stream: RequestStream, timeout: float | None = None) -> Terminal | None:
    """Block (no event loop needed) until ``stream``'s terminal; None after ``timeout``
    seconds. Woken by the stream itself, not by a callback on the producer's thread."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        seen = stream.last_seq  # NOTE: read before the terminal, so no append is missed
        if (terminal := stream.terminal) is not None:
            return terminal
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        stream.wait_after(seen, left)


class StreamReading:
    """The reading half every engine handle shares (in process, rebuilt from the durable log,
    mirrored, or remote): ``events`` replays after ``after`` then follows live ones, ending
    after the terminal (at once from at or past it); ``result`` waits for the terminal. Both
    acknowledge what they read (P3, P6). A handle sets ``stream`` and adds its own cancel."""

    stream: RequestStream

    def events(self, after: int = -1) -> AsyncIterator[StreamEvent]:
        return follow(self.stream, after)

    async def result(self) -> Terminal:
        return await terminal_of(self.stream)


async def logged_until(streams: Sequence[RequestStream], ready: Callable[[], bool]) -> None:
    """Wait (on the running loop) until ``ready()``, re-checked after every append to
    ``streams``; the caller makes ``ready`` true once they ended. A resume that names a
    position a live stream has not logged yet (a reader of another ingress may be ahead of
    this log, with ``--redis-url``) is judged once the log holds it or ended (P3)."""
    wake = asyncio.Event()
    removers = [s.subscribe(lambda _seq: wake.set()) for s in streams]
    try:
        while True:
            wake.clear()  # NOTE: before the check, so no append is missed
            if ready():
                return
            await wake.wait()
    finally:
        for remove in removers:
            remove()
