"""The ordered, replayable stream of one request (SPEC P1, P2, P3, P6, L3; seed 000 §4.7, §4.8).

Every event carries a sequence number, strictly increasing from 0 within the request: the
``start`` event is 0, deltas follow, the single terminal event is last (P1, P2). The log is
kept so a reconnecting reader can replay from any sequence number (P3); a client merging
replays dedupes by ``(request_id, seq)``; readers read through :mod:`coda.reader`.

Backpressure (P6) is declared per stream (:mod:`coda.stream_backpressure`): past its bound a
delta raises :class:`~coda.errors.BackpressureOverflowError`, never a silent drop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from coda.errors import BackpressureOverflowError
from coda.finish import Terminal
from coda.stream_backpressure import DEFAULT_BACKPRESSURE, BackpressureConfig, BackpressurePolicy
from coda.wakeup import CHANNEL, Observer, WakeChannel


class EventType(StrEnum):
    START = "start"
    DELTA = "delta"
    TERMINAL = "terminal"


@dataclass(frozen=True)
class TokenInfo:
    """One selected token as the API reports it (logprobs), as plain data: the engine fills
    in each token's exact bytes in context (``piece``; ``top_pieces`` for the alternatives,
    in ``top_logprobs`` order) and whether it is a special token, so a reader renders logprobs
    without a tokenizer (issue 11 item 4)."""

    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    piece: bytes = b""
    top_pieces: tuple[bytes, ...] = ()
    special: bool = False


def shown_piece(t: TokenInfo, skip_special: bool) -> bytes:
    """The bytes ``t`` adds to the text: none for a special token the request skips (its bytes
    are a removed span, K2); what its logprob entry shows."""
    return b"" if skip_special and t.special else t.piece


def shown_bytes(t: TokenInfo, skip_special: bool) -> int:
    """How many bytes ``t`` adds to the text (:func:`shown_piece`)."""
    return len(shown_piece(t, skip_special))


@dataclass(frozen=True)
class StreamEvent:
    request_id: str
    seq: int
    type: EventType
    data: bytes = b""
    tokens: tuple[TokenInfo, ...] = ()
    model: str | None = None
    model_snapshot: str | None = None  # P1: the content identity (start event only)
    terminal: Terminal | None = None
    ts: float = field(default_factory=time.monotonic)
    # L6: prompt tokens the prefix cache held, on the first delta only (it comes after the
    # lookup): what a protocol that states usage up front (Anthropic message_start) sends
    cached_prompt_tokens: int | None = None
    # Issue 23: this delta is reasoning (before the closing marker), not answer. Every
    # reasoning delta comes before every answer delta; a renderer splits on this flag.
    reasoning: bool = False
    # P3: the durable log's order of the run this event was written in (strictly increasing
    # per run, kept in the log beside it); when set, the n > 1 merge orders by it instead of
    # ``ts``, so a stream rebuilt from the log interleaves as the first delivery did
    # (:func:`coda.reader.merge_order`). None: not from the durable log (or an older log).
    merge_key: int | None = None

    @property
    def text(self) -> str:
        # NOTE: deltas always end on a UTF-8 character boundary (the detokenizer emits whole
        # characters and a held stop prefix starts on a lead byte), so this never fails.
        return self.data.decode("utf-8")


class StreamClosed(RuntimeError):
    """An event offered after the terminal (L3); a programming error, never silently dropped."""




class RequestStream:
    """Append-only, sequence-numbered event log of one request; thread-safe.

    Producers append with :meth:`start`, :meth:`delta` and :meth:`close`; each append posts
    ``(stream, seq)`` to the one wake-up channel (:mod:`coda.wakeup`) and nothing else runs on
    the producer's thread. Readers take :meth:`events_after`; observers on an event loop are
    woken there (:meth:`subscribe`), a blocking reader waits with :meth:`wait_after`.
    """

    # NOTE: P3: a copy rebuilt from the durable log while it may still grow (another front
    # end's follower), or an ingress's copy of a replica's keyed events (with --redis-url):
    # merged only up to what every choice's log is past (coda.reader)
    log_ordered = False

    def __init__(self, request_id: str, backpressure: BackpressureConfig | None = None, *,
                 channel: WakeChannel | None = None, model: str | None = None,
                 model_snapshot: str | None = None) -> None:
        """``model``: the log opens with its start event (seq 0, P1) for that model and
        content identity, appended here (issue 22: the engine never calls back to start it);
        None: the producer appends it with :meth:`start` (a copy, a worker's parent side)."""
        self.request_id = request_id
        self.backpressure = backpressure or DEFAULT_BACKPRESSURE
        self._events: list[StreamEvent] = []
        self._lock = threading.Lock()
        # NOTE: the blocking readers' wake-up (no callback: they wait on the stream itself)
        self._appended = threading.Condition(self._lock)
        self._sync_waiters = 0  # NOTE: appends notify only while someone blocks
        self._channel = channel if channel is not None else CHANNEL
        self._acked_seq = -1
        self._unacked_bytes = 0
        self._ended = False  # NOTE: the terminal is fixed: nothing more is appended (L2, L3)
        self._held: StreamEvent | None = None  # NOTE: ... but not yet published (close, hold)
        self._closed = False  # NOTE: the terminal is in the log: readers see the end
        self._live = True  # NOTE: until release_live (L7 stream_buffer)
        if model is not None:
            # NOTE: nobody can have subscribed to a stream being built: nothing to post
            self._events.append(StreamEvent(request_id, 0, EventType.START, model=model,
                                            model_snapshot=model_snapshot))

    # -- producer side -------------------------------------------------------------------
    def start(self, model: str, model_snapshot: str | None = None) -> StreamEvent:
        """Event 0: start(request_id, model_snapshot) (P1)."""
        with self._lock:
            if self._events:
                raise StreamClosed("start must be the first event")
            ev = StreamEvent(self.request_id, 0, EventType.START, model=model,
                             model_snapshot=model_snapshot)
            self._events.append(ev)
            if self._sync_waiters:
                self._appended.notify_all()
        self._channel.post(self, 0)
        return ev

    def delta(self, data: bytes, tokens: tuple[TokenInfo, ...] = (),
              cached_prompt_tokens: int | None = None, *, reasoning: bool = False) -> StreamEvent:
        """Append a non-empty delta; raises StreamClosed after the terminal (L3) and
        BackpressureOverflowError past the bound (P6), without appending."""
        if not data:
            raise ValueError("empty delta")
        with self._lock:
            if self._ended:
                raise StreamClosed(f"{self.request_id}: delta after the terminal event")
            if self._unacked_bytes + len(data) > self.backpressure.max_bytes:
                raise BackpressureOverflowError(
                    f"{self.request_id}: reader is {self._unacked_bytes} bytes behind "
                    f"(bound {self.backpressure.max_bytes})"
                )
            ev = StreamEvent(self.request_id, len(self._events), EventType.DELTA, data, tokens,
                             cached_prompt_tokens=cached_prompt_tokens, reasoning=reasoning)
            self._events.append(ev)
            self._unacked_bytes += len(data)
            if self._sync_waiters:
                self._appended.notify_all()
        self._channel.post(self, ev.seq)
        return ev

    def close(self, terminal: Terminal, *, hold: bool = False) -> StreamEvent:
        """Append the single terminal event (P2). Call it from inside the lifecycle's
        terminal critical section (L2). ``hold``: fixed (its seq; nothing can follow it, L2,
        L3) and queued, but seen by readers only from :meth:`publish` (RequestRun._end seals
        the request's trace in between, O1, L7)."""
        with self._lock:
            if self._ended:
                raise StreamClosed(f"{self.request_id}: second terminal event")
            self._ended = True
            ev = StreamEvent(self.request_id, len(self._events), EventType.TERMINAL,
                             terminal=terminal)
            self._held = ev
        if not hold:
            self.publish()
        return ev

    def publish(self) -> None:
        """Append the terminal event :meth:`close` queued and wake its readers (a no-op
        without one, or once done). From the thread that closed the stream."""
        with self._lock:
            ev, self._held = self._held, None
            if ev is None:
                return
            self._closed = True
            self._events.append(ev)
            if self._sync_waiters:
                self._appended.notify_all()
        self._channel.post(self, ev.seq, final=True)

    def extend(self, events: list[StreamEvent], merge_key: int | None = None) -> int:
        """Append copies of another log's events of this request (a durable copy, a stream
        rebuilt from the stream log), skipping those already here (seq at or below
        ``last_seq``); returns how many were appended. One lock acquisition and one wake-up
        for all of them. Each copy is stamped with this stream's clock at append time, like
        every event (the consistent-cut rule of :mod:`coda.reader`); ``merge_key``, if given,
        replaces the events' own (the durable log's order of their run). The checks of
        :meth:`start`, :meth:`delta` and :meth:`close` apply; a seq past the next one is
        refused (a gap)."""
        with self._lock:
            now = time.monotonic()
            n = 0
            for ev in events:
                if ev.seq < len(self._events):
                    continue
                if ev.seq > len(self._events):
                    raise ValueError(f"{self.request_id}: seq {ev.seq} leaves a gap")
                if self._ended:
                    raise StreamClosed(f"{self.request_id}: event after the terminal event")
                if (ev.type is EventType.START) is not (ev.seq == 0):
                    raise StreamClosed("start must be the first event, and only it")
                if ev.type is EventType.DELTA:
                    if not ev.data:
                        raise ValueError("empty delta")
                    if self._unacked_bytes + len(ev.data) > self.backpressure.max_bytes:
                        raise BackpressureOverflowError(
                            f"{self.request_id}: reader is {self._unacked_bytes} bytes behind "
                            f"(bound {self.backpressure.max_bytes})")
                    self._unacked_bytes += len(ev.data)
                elif ev.type is EventType.TERMINAL:
                    self._ended = self._closed = True
                # NOTE: dataclasses.replace would run __init__ (~2 us an event); a frozen
                # dataclass keeps its fields in __dict__, so a re-stamped copy is a dict copy
                copy = object.__new__(StreamEvent)
                copy.__dict__.update(ev.__dict__, request_id=self.request_id, ts=now)
                if merge_key is not None:
                    copy.__dict__["merge_key"] = merge_key
                self._events.append(copy)
                n += 1
            if n and self._sync_waiters:
                self._appended.notify_all()
            last, final = len(self._events) - 1, self._closed
        if n:
            self._channel.post(self, last, final=final)
        return n

    # -- reader side ---------------------------------------------------------------------
    def events_after(self, seq: int) -> list[StreamEvent]:
        """Events with sequence number > ``seq`` (``-1`` replays everything) (P3)."""
        with self._lock:
            return self._events[max(seq + 1, 0):]

    def ack(self, seq: int) -> None:
        """The reader has consumed everything up to ``seq``: frees backpressure credit."""
        with self._lock:
            if seq <= self._acked_seq:
                return
            freed = sum(len(e.data) for e in self._events[self._acked_seq + 1: seq + 1])
            self._acked_seq = seq
            if self._live:  # NOTE: after release_live the credit was already returned
                self._unacked_bytes -= freed

    def release_live(self) -> dict[str, int]:
        """The L7 ``stream_buffer`` release, after the terminal (held or published): live
        delivery ends. The backpressure credit still owed by slow readers is returned
        (``unacked_bytes`` drops to 0, so nothing can pause or overflow on this stream again);
        the observers still subscribed (``listeners``) are dropped by the channel once the
        terminal's wake-up reached them (nothing is appended after it). The event log stays: a
        reader that reconnects later still replays it (P3). Returns what it freed, for the
        trace row (a second release frees nothing)."""
        with self._lock:
            if not self._ended:
                raise StreamClosed(f"{self.request_id}: stream buffer released before the terminal")
            if not self._live:
                return {"unacked_bytes": 0, "listeners": 0}
            freed = {"unacked_bytes": self._unacked_bytes,
                     "listeners": self._channel.num_subscribed(self)}
            self._unacked_bytes = 0
            self._live = False
        return freed

    def subscribe(self, callback: Observer,
                  loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
        """Call ``callback(seq)`` on ``loop`` (default: the running one) after appends, never
        on the producer's thread (:class:`coda.wakeup.WakeChannel`); returns the remover."""
        return self._channel.subscribe(self, callback, loop)

    def wait_after(self, seq: int, timeout: float | None = None) -> bool:
        """Block (without an event loop) until an event after ``seq`` exists; False after
        ``timeout`` seconds without one. For the synchronous Python API."""
        with self._appended:
            self._sync_waiters += 1
            try:
                return self._appended.wait_for(lambda: len(self._events) - 1 > seq, timeout)
            finally:
                self._sync_waiters -= 1

    @property
    def closed(self) -> bool:
        """The terminal is in the log (published): a reader sees the end."""
        return self._closed

    @property
    def model_snapshot(self) -> str | None:
        with self._lock:
            return self._events[0].model_snapshot if self._events else None

    @property
    def last_seq(self) -> int:
        return len(self._events) - 1

    @property
    def terminal(self) -> Terminal | None:
        with self._lock:
            last = self._events[-1] if self._closed else None
        return last.terminal if last is not None else None

    @property
    def live(self) -> bool:
        """False once the stream buffer was released (L7); the log stays readable."""
        return self._live

    @property
    def unacked_bytes(self) -> int:
        return self._unacked_bytes

    @property
    def should_pause(self) -> bool:
        """P6 policy 1: the scheduler skips this request while True."""
        return (self.backpressure.policy is BackpressurePolicy.PAUSE
                and not self._ended
                and self._unacked_bytes >= self.backpressure.pause_bytes)

    def text(self) -> str:
        """All delta bytes so far, concatenated in sequence order."""
        with self._lock:
            return b"".join(e.data for e in self._events).decode("utf-8")
