"""Copying between an engine's in-memory streams and the durable log (issue 12 item 2; SPEC
P1–P3, P6).

:class:`LogMirror` writes: every watched :class:`~coda.stream.RequestStream` is copied, in seq
order, into the :class:`~coda.durable.redis_log.RedisStreamLog` by one writer thread (the
engine thread never waits on Redis, nor runs the mirror's code: the mirror is woken on the
event loop by the wake-up channel, :mod:`coda.wakeup`); the events of a wake-up go in one pipelined round trip.
:class:`LogFollower` reads: it rebuilds a request's stream on another ingress from the log —
replay, then live with ``XREAD BLOCK`` — into a local ``RequestStream`` that the SSE renderers
read as if the engine were local.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from coda.durable.redis_log import RedisStreamLog
from coda.stream import EventType, RequestStream, StreamEvent
from coda.stream_backpressure import BackpressureConfig
from coda.wakeup import CHANNEL

log = logging.getLogger("coda.durable")

# NOTE: a followed copy is acknowledged by its own readers; its bound is the log's, not P6's
_UNBOUNDED = BackpressureConfig(pause_bytes=1 << 62, max_bytes=1 << 62)


class DurableCopy(RequestStream):
    """What readers see of a mirrored stream: only events already appended to the log (the
    first frame a client gets is durable, seed 004). Acknowledging it acknowledges the
    engine's stream too, so backpressure (P6) still follows the client."""

    def __init__(self, source: RequestStream) -> None:
        super().__init__(source.request_id, _UNBOUNDED)
        self.source = source

    def ack(self, seq: int) -> None:
        super().ack(seq)
        self.source.ack(seq)


def feed(stream: RequestStream, events: list[StreamEvent]) -> None:
    """Append ``events`` to a local copy in seq order, skipping those it already has (XREAD
    may repeat the boundary entry; a replica's feed may too)."""
    stream.extend(events)


@dataclass
class _Watched:
    stream: RequestStream
    copy: DurableCopy
    record_id: str
    on_fenced: Callable[[], None]
    ack_on_write: bool = False
    written: int = -1


# NOTE: the default flush hold (see LogMirror): what an event may wait before its flush starts
HOLD_S = 0.002


class LogMirror:
    """One writer thread copying watched streams into ``log`` (idempotent appends).

    When to flush (issue 24 item 1): an engine appends one delta per running request in a
    burst at the end of each step, and a flush that starts at the burst's first append sends
    the rest as a second run per request (Redis's cost is per run). ``steps``: the engine
    whose streams this mirrors (:class:`~coda.engine.async_engine.AsyncEngine`: its
    ``stepping`` flag, each step's end posted on the wake-up channel with it as the source) —
    an append observed while a step runs is flushed at that step's end, one observed between
    steps at once: one flush per step, and time to durable grows only by the rest of the
    step's burst. Without it, ``hold_s``: after a wake-up the writer waits this long before it
    takes what is new (so at most ``hold_s`` is added to every event's time to durable, and
    so to the first frame, seed 004); 0 flushes at once. Either way a writer that is busy
    gathers several steps per flush.

    The copies of a flush are appended while ``stepping`` is set, and the flush's end is
    posted on the wake-up channel with the mirror as the source: a replica's feed sends one
    message per flush (:class:`coda.scaleout.feed.Outbox`)."""

    def __init__(self, durable: RedisStreamLog, *, hold_s: float = HOLD_S,
                 steps: Any = None) -> None:
        self.log = durable
        self.hold_s = hold_s
        self.steps = steps
        self.stepping = False
        self.flushes = 0
        self._step_loops: set[asyncio.AbstractEventLoop] = set()
        self._watched: dict[str, _Watched] = {}
        self._dirty: set[str] = set()
        self._cond = threading.Condition()
        # NOTE: the writer's wake-up; set by appends without taking the lock (see mark)
        self._pending = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="coda-log-mirror", daemon=True)
        self._thread.start()

    def _step_ended(self, _step: int) -> None:  # NOTE: on an observers' loop (the channel)
        # NOTE: checked after the rest of this dispatch: a dispatch that comes late calls the
        # engine's (older) entry first, then the marks of the step that just ended
        asyncio.get_running_loop().call_soon(self._wake_if_dirty)

    def _wake_if_dirty(self) -> None:
        if self._dirty and not self._pending.is_set():
            self._pending.set()

    def watch(self, stream: RequestStream, *, record_id: str, prompt_tokens: int,
              on_fenced: Callable[[], None], opened: bool = False,
              ack_on_write: bool = False,
              loop: asyncio.AbstractEventLoop | None = None) -> DurableCopy:
        """Own ``stream`` in the log from now on and copy every event of it (from seq 0);
        returns the copy readers should read (events reach it once durable). ``opened``: this
        server already owns the request in the log (it claimed it, :meth:`RedisStreamLog.take`).
        ``ack_on_write``: the log is the reader (a replica whose caller may be gone), so a
        durable write acknowledges the engine's stream (P6 then follows the log). The
        mirror observes the stream on ``loop`` (default: the running one; issue 22 step 4)."""
        rid = stream.request_id
        if not opened:
            self.log.open(rid, prompt_tokens=prompt_tokens, record_id=record_id)
        copy = DurableCopy(stream)
        steps = self.steps
        if steps is not None:
            lp = loop if loop is not None else asyncio.get_running_loop()
            if lp not in self._step_loops:  # NOTE: one subscription per observers' loop
                self._step_loops.add(lp)
                CHANNEL.subscribe(steps, self._step_ended, lp)
        with self._cond:
            self._watched[rid] = _Watched(stream, copy, record_id, on_fenced, ack_on_write)
            self._dirty.add(rid)
        if steps is None or not steps.stepping:  # NOTE: else with the running step's flush
            self._pending.set()

        def mark(_seq: int) -> None:  # NOTE: on the event loop, woken by the channel
            # NOTE: no lock: set.add is atomic, and the writer takes the dirty ids only after
            # clearing _pending, so an append is either in this round's read of the stream
            # (taken after its mark) or sets _pending again for the next round
            self._dirty.add(rid)
            # NOTE: a step running now posts its end after its appends (_step_ended)
            if (steps is None or not steps.stepping) and not self._pending.is_set():
                self._pending.set()

        stream.subscribe(mark, loop)  # NOTE: dropped by the channel after the terminal
        return copy

    def _run(self) -> None:
        while True:
            self._pending.wait()
            if self.steps is None and self.hold_s > 0 and not self._stopping:
                time.sleep(self.hold_s)  # NOTE: gather the rest of the step (see hold_s)
            with self._cond:
                self._pending.clear()
                if self._stopping and not self._dirty:
                    return
                ids = list(self._dirty)  # NOTE: atomic (one C call under the GIL)
                self._dirty.difference_update(ids)
                batch = [self._watched[r] for r in ids if r in self._watched]
            self._flush(batch)

    def _flush(self, batch: list[_Watched]) -> None:
        """Everything new in ``batch`` in one pipelined round trip (issue 12 item 6): one run
        per request (its events after what is written: consecutive, a terminal only last).

        The copies are extended in the order of the runs' merge keys (P3): run ``i`` of this
        flush has key ``first + i``, above every earlier flush's, and is appended to its copy
        stamped after the copies before it, so the live merge (by merge key, cut by clock,
        :mod:`coda.reader`) delivers exactly the order a stream rebuilt from the log has."""
        todo = [(w, evs) for w in batch if (evs := w.stream.events_after(w.written))]
        if not todo:
            return
        first = self.log.merge_keys(len(todo))
        try:
            results = self.log.append_runs([(evs, w.record_id) for w, evs in todo], first)
            pieces = self._pieces(todo, results, first)
        except redis.RedisError:
            # NOTE: retried at the next append or flush (appends are idempotent)
            log.exception("stream log append failed")
            with self._cond:
                self._dirty.update(w.stream.request_id for w, _ in todo)
            self._pending.set()
            time.sleep(0.1)
            return
        self.stepping = True
        try:
            for (w, _), (code, _) in zip(todo, results, strict=True):
                if code == -1:
                    rid = w.stream.request_id
                    log.warning("request taken over by a peer; cancelling locally",
                                extra={"request_id": rid})
                    self._forget(rid)
                    w.on_fenced()
            for key, w, evs in sorted(pieces, key=lambda p: p[0]):
                w.written = evs[-1].seq
                w.copy.extend(evs, key)
                if w.ack_on_write:
                    w.stream.ack(w.written)
                if evs[-1].type is EventType.TERMINAL:
                    self._forget(w.stream.request_id)
        finally:
            self.stepping = False
            self.flushes += 1
            CHANNEL.post(self, self.flushes)  # NOTE: the copies' burst ended (see the class)

    def _pieces(self, todo: list[tuple[_Watched, list[StreamEvent]]],
                results: list[tuple[int, int]], first: int
                ) -> list[tuple[int, _Watched, list[StreamEvent]]]:
        """``(merge key, watched, events)`` to append to the copies: each written run with
        its key. A run the log already held in part (an append retried after its reply was
        lost) is read back, so its copy gets the keys the log holds (P3). A fenced run has
        none; a run after the terminal is a duplicate of what the copy got."""
        out = []
        for i, ((w, evs), (code, prev_last)) in enumerate(zip(todo, results, strict=True)):
            if code == -1:
                continue
            if prev_last < evs[0].seq:
                out.append((first + i, w, evs))
                continue
            runs: dict[int, list[StreamEvent]] = {}
            for ev in self.log.read(w.stream.request_id, w.written):
                # NOTE: an entry of an older writer has no key: it goes with the next one
                runs.setdefault(ev.merge_key if ev.merge_key is not None else first + i,
                                []).append(ev)
            out += [(key, w, run) for key, run in runs.items()]
        return out

    def _forget(self, rid: str) -> None:
        with self._cond:
            self._watched.pop(rid, None)

    def flush(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout``) until every watched stream's terminal is written, then
        write what is left and stop the writer."""
        deadline = time.monotonic() + timeout
        while self._watched and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._cond:
            self._dirty.update(self._watched)
            self._stopping = True
        self._pending.set()
        self._thread.join(timeout)

    @property
    def num_watched(self) -> int:
        return len(self._watched)


class LogFollower:
    """A local ``RequestStream`` fed from the log of ``request_id`` by a daemon thread."""

    def __init__(self, durable: RedisStreamLog, request_id: str) -> None:
        self.log = durable
        self.stream = RequestStream(request_id, _UNBOUNDED)
        self.stream.log_ordered = True  # NOTE: its events come as the log gets them (P3)
        self._stop = threading.Event()
        self._feed(durable.read(request_id))
        if not self.stream.closed:
            threading.Thread(target=self._run, name="coda-log-follow", daemon=True).start()

    def _feed(self, events: list[StreamEvent]) -> None:
        feed(self.stream, events)

    def _run(self) -> None:
        rid = self.stream.request_id
        while not self._stop.is_set() and not self.stream.closed:
            try:
                evs = self.log.wait(rid, self.stream.last_seq, 1.0)
                if not evs and not self.log.exists(rid):
                    return  # NOTE: expired (retention) or never written
                self._feed(evs)
            except redis.RedisError:
                log.exception("stream log read failed", extra={"request_id": rid})
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
