"""The one wake-up channel between a stream's producer and its observers (issue 22 step 4;
SPEC P2, P3, P6).

A producer (the engine thread, a log follower, a replica's pump) appends an event to a
:class:`~coda.stream.RequestStream` and posts ``(stream, seq)`` here — the request's id and
the seq appended; that is all it does for the observers. Observers (stream readers, metrics, the durable mirror, a replica's feed)
subscribe per request **on an event loop**, and their callbacks run there: a post from another
thread schedules one dispatch on each loop that has a subscriber for the request, so no
callback of a higher layer ever runs on the engine thread, and a burst of appends costs one
self-pipe write per loop, not one per event per observer.

Posts of one stream are coalesced while a dispatch is pending: an observer is called with the
latest seq posted since its last call (every observer reads the log itself, replay-then-follow,
so a wake-up says only "there is something after what you read"). After the post of a
stream's terminal (``final``) is dispatched, the channel drops that stream's subscriptions.
Subscriptions are by stream, not by request id: a request's durable copy, a log follower and
the engine's own stream share the id but not their wake-ups.

An observer of every stream's end (the server's metrics: one per app, not one subscription
per request) listens with :meth:`WakeChannel.on_end`: it is called on its loop with each
stream whose terminal is posted after it started listening.

Readers without an event loop (``RequestHandle.wait``, the blocking Python API) never need a
callback: they wait on the stream's own condition (:meth:`RequestStream.wait_after`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger("coda.stream")

Observer = Callable[[int], None]
EndObserver = Callable[[Hashable], None]
_Sub = tuple[Observer, asyncio.AbstractEventLoop]  # NOTE: one subscription: compared by identity


class WakeChannel:
    """``post(stream, seq)`` from any thread; ``subscribe(stream, callback)`` on an event
    loop, whose callback then runs on that loop with the latest seq posted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # NOTE: per stream: its subscriptions, each a (callback, loop) pair in subscription
        # order (no object of its own: issue 22's per-request count); removed = absent
        self._subs: dict[Hashable, list[_Sub]] = {}
        # NOTE: per loop with a dispatch scheduled: stream -> (latest seq, final posted)
        self._pending: dict[asyncio.AbstractEventLoop, dict[Hashable, tuple[int, bool]]] = {}
        # NOTE: per loop: the observers of every stream's end (on_end)
        self._enders: dict[asyncio.AbstractEventLoop, list[EndObserver]] = {}

    def post(self, source: Hashable, seq: int, *, final: bool = False) -> None:
        """A producer appended ``seq`` to ``source``'s log (``final``: its terminal)."""
        # NOTE: unlocked fast path (a dict lookup is atomic): a subscriber that is not in the
        # map yet subscribed after this append, so its first read of the log sees it
        if source not in self._subs and not (final and self._enders):
            return
        with self._lock:
            loops = {at for _, at in self._subs.get(source, ())}
            if final:
                loops.update(self._enders)
            schedule: list[asyncio.AbstractEventLoop] = []
            for loop in loops:
                pending = self._pending.get(loop)
                if pending is None:
                    self._pending[loop] = {source: (seq, final)}
                    schedule.append(loop)
                else:
                    prev = pending.get(source, (-1, False))
                    pending[source] = (max(seq, prev[0]), final or prev[1])
        for loop in schedule:
            self._schedule(loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        try:
            if running is loop:
                loop.call_soon(self._dispatch, loop)  # NOTE: no self-pipe write on the loop
            else:
                loop.call_soon_threadsafe(self._dispatch, loop)
        except RuntimeError:  # NOTE: the loop is closed: nobody is left there to wake
            with self._lock:
                self._enders.pop(loop, None)
                for source in self._pending.pop(loop, {}):
                    self._drop(source, loop)

    def _dispatch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On ``loop``: call its observers of every stream posted since the last dispatch."""
        with self._lock:
            pending = self._pending.pop(loop, {})
            calls = [(src, sub, seq) for src, (seq, _) in pending.items()
                     for sub in self._subs.get(src, ()) if sub[1] is loop]
        for src, sub, seq in calls:
            with self._lock:  # NOTE: lists change in place (remove() from any thread)
                live = any(s is sub for s in self._subs.get(src, ()))
            if not live:
                continue  # NOTE: removed by an earlier callback of this dispatch
            try:
                sub[0](seq)
            except Exception:  # NOTE: one observer's bug must not starve the others
                log.exception("stream observer failed")
        finals = [src for src, (_, final) in pending.items() if final]
        if finals:
            with self._lock:
                for src in finals:
                    self._drop(src, loop)
                enders = list(self._enders.get(loop, ()))
            for src in finals:
                for ender in enders:
                    try:
                        ender(src)
                    except Exception:  # NOTE: as above: the other observers still run
                        log.exception("stream end observer failed")

    def _drop(self, source: Hashable, loop: asyncio.AbstractEventLoop) -> None:
        subs = [s for s in self._subs.get(source, ()) if s[1] is not loop]
        if subs:
            self._subs[source] = subs
        else:
            self._subs.pop(source, None)

    def subscribe(self, source: Hashable, callback: Observer,
                  loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
        """Call ``callback(seq)`` on ``loop`` (default: the running loop) after appends to
        ``source`` (a stream); returns the remover (idempotent). A subscriber reads the log after
        subscribing, so an append between the two is seen either way."""
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise RuntimeError(
                    "stream observers subscribe on an event loop; a blocking reader waits "
                    "with RequestStream.wait_after") from None
        sub: _Sub = (callback, loop)
        with self._lock:
            self._subs.setdefault(source, []).append(sub)

        def remove() -> None:
            with self._lock:
                subs = self._subs.get(source, [])
                for i, s in enumerate(subs):
                    if s is sub:  # NOTE: this subscription, not an equal pair
                        del subs[i]
                        break
                if not subs:
                    self._subs.pop(source, None)

        return remove

    def on_end(self, callback: EndObserver,
               loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
        """Call ``callback(stream)`` on ``loop`` (default: the running one) after the terminal
        of any stream posting here from now on, once per stream; returns the remover. One
        listener for every request's end (the server's metrics), where a subscription per
        request would be one more object per request."""
        loop = loop if loop is not None else asyncio.get_running_loop()
        with self._lock:
            self._enders.setdefault(loop, []).append(callback)

        def remove() -> None:
            with self._lock:
                enders = self._enders.get(loop, [])
                if callback in enders:
                    enders.remove(callback)
                if not enders:
                    self._enders.pop(loop, None)

        return remove

    def num_subscribed(self, source: Hashable) -> int:
        with self._lock:
            return len(self._subs.get(source, ()))


# NOTE: the process's one channel: every stream posts here unless given its own (tests)
CHANNEL = WakeChannel()
