"""The worker's sender: a model worker's events and billing reports on their way to the parent
(issue 23 item 1; SPEC P1, P6, L6).

The engine's own :class:`~coda.stream.RequestStream` stays the one producer; one thread
forwards each submitted stream's events in seq order, each seq once, as ``("events", [(request_id,
[StreamEvent, ...]), ...], [(request_id, Usage), ...])`` (the message format is
:mod:`coda.engine.process_worker`'s), and the parent appends them with ``RequestStream.extend``.
With a stream's events goes its billing report, whose returned bytes are exactly those events'
(:mod:`coda.engine.local_end` bills it if the process dies); every ``_REPORT_S`` every open
stream is looked at again, so tokens that moved no event are reported too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from coda.finish import Usage
from coda.stream import EventType, RequestStream, StreamEvent

__all__ = ["WorkerSender"]

# NOTE: how soon a selected token that moved no event (held back by a stop, say) is reported
_REPORT_S = 0.02
_MARK_TRIES = 200  # NOTE: waits for a processor's sent mark to catch up with its last delta


class WorkerSender:
    """Forwards the events of every submitted stream to the parent: each stream's wake-ups
    (:mod:`coda.wakeup`, on this worker's own small event loop) mark it dirty; one thread sends
    everything new in one message per wake-up. With each stream's events goes its billing
    report (:meth:`coda.request.RequestRun.live_usage`), whose returned bytes are those
    events' (the parent bills it if this process dies); every ``_REPORT_S`` every open stream
    is looked at again, so tokens no event carries yet are reported too."""

    def __init__(self, send: Any) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._dirty: dict[str, RequestStream] = {}
        self._pos: dict[str, int] = {}
        self._streams: dict[str, RequestStream] = {}
        self._usage: dict[str, Callable[[], Usage]] = {}
        # NOTE: only the sender thread reads or writes these two
        self._shown: dict[str, int] = {}
        self._reported: dict[str, Usage] = {}
        self._stopping = False
        # NOTE: stream observers run on an event loop, never on the engine thread
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="coda-worker-wakeups",
                         daemon=True).start()
        self._thread = threading.Thread(target=self._run, name="coda-worker-sender", daemon=True)
        self._thread.start()

    def forward(self, stream: RequestStream, usage: Callable[[], Usage] | None = None) -> None:
        rid = stream.request_id
        with self._cond:
            self._pos[rid] = -1
            self._streams[rid] = stream
            if usage is not None:
                self._usage[rid] = usage

        def mark(_seq: int = -1) -> None:  # NOTE: after appends (on the wake-up loop)
            with self._cond:
                if rid in self._pos:
                    self._dirty[rid] = stream
                    self._cond.notify()

        stream.subscribe(mark, self._loop)
        mark()  # NOTE: the start event was appended before the subscription

    def _run(self) -> None:
        try:
            self._forward_all()
        except BaseException:
            # NOTE: events can no longer reach the server: end the process, so the server
            # ends its requests (FAILED, the worker exited) instead of waiting forever
            logging.getLogger("coda.engine").exception("model worker sender failed")
            os._exit(70)

    def _forward_all(self) -> None:
        next_report = time.monotonic() + _REPORT_S
        while True:
            with self._cond:
                if not self._dirty and not self._stopping:
                    self._cond.wait(_REPORT_S if self._pos else None)
                if not self._dirty and self._stopping:
                    return
                todo, self._dirty = self._dirty, {}
                if time.monotonic() >= next_report:
                    next_report = time.monotonic() + _REPORT_S
                    todo.update((r, s) for r, s in self._streams.items() if r not in todo)
            batch: list[tuple[str, list[StreamEvent]]] = []
            reports: list[tuple[str, Usage]] = []
            for rid, stream in todo.items():
                # NOTE: only this thread reads and advances a stream's position: each seq once
                with self._cond:
                    pos = self._pos.get(rid)
                    usage = self._usage.get(rid)
                if pos is None:
                    continue  # NOTE: its terminal was sent; later marks are acks
                evs = stream.events_after(pos)
                report = None
                if usage is not None:
                    evs, report = self._report(rid, stream, pos, evs, usage)
                if not evs and report is None:
                    continue
                if evs:
                    batch.append((rid, evs))
                if report is not None:
                    reports.append((rid, report))
                with self._cond:
                    if evs and evs[-1].type is EventType.TERMINAL:
                        del self._pos[rid], self._streams[rid]
                        self._usage.pop(rid, None)
                        self._shown.pop(rid, None)
                        self._reported.pop(rid, None)
                    elif evs:
                        self._pos[rid] = evs[-1].seq
            if batch or reports:
                self._send(("events", batch, reports))

    def _report(self, rid: str, stream: RequestStream, pos: int, evs: list[StreamEvent],
                usage: Callable[[], Usage]) -> tuple[list[StreamEvent], Usage | None]:
        """The billing report going with ``evs`` (None: nothing new, or the terminal is
        among them): its returned bytes are the bytes of every delta sent with it (read again
        until they are: the processor moves its mark just after appending a delta)."""
        if evs and evs[-1].type is EventType.TERMINAL:
            return evs, None
        shown = self._shown.get(rid, 0) + sum(len(e.data) for e in evs)
        u = usage()
        for _ in range(_MARK_TRIES):
            if u.returned_bytes == shown:
                break
            if u.returned_bytes > shown:  # NOTE: a delta appended after the events were read
                more = stream.events_after(evs[-1].seq if evs else pos)
                evs = evs + more
                shown += sum(len(e.data) for e in more)
                if more and more[-1].type is EventType.TERMINAL:
                    return evs, None
            else:
                time.sleep(0.0005)
            u = usage()
        # NOTE: a mark that never matched goes as it is: the parent sees it does not match
        self._shown[rid] = shown
        if not evs and self._reported.get(rid) == u:
            return evs, None
        self._reported[rid] = u
        return evs, u

    def stop(self) -> None:
        """Send what is left of every stream (its terminal included: the engine has shut
        down), then stop."""
        with self._cond:
            # NOTE: a wake-up may still be in flight: read every open stream once more
            self._dirty.update((rid, self._streams[rid]) for rid in self._pos)
            self._stopping = True
            self._cond.notify()
        self._thread.join(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
