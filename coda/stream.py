"""The ordered, replayable stream of one request (SPEC P1, P2, P3, P6, L3; seed 000 §4.7, §4.8).

Every event carries a sequence number, strictly increasing from 0 within the request: the
``start`` event is 0, deltas follow, the single terminal event is last (P1, P2). The log is
kept so a reconnecting reader can replay from any sequence number (P3); a client merging
replays dedupes by ``(request_id, seq)``; readers read through :mod:`coda.reader`.

Backpressure (P6) is declared per stream by :class:`BackpressureConfig`:
1. ``PAUSE`` — past ``pause_bytes`` of unacknowledged output, ``should_pause`` tells the
   scheduler to stop stepping this request until the reader catches up;
2. ``BUFFER`` — keep generating into the buffer;
3. in both, the buffer is bounded by ``max_bytes``: a delta that would pass it raises
   :class:`~coda.errors.BackpressureOverflowError` (nothing is dropped silently) and the owner
   ends the request with that error. Never an unbounded buffer, never a complete text claimed
   after a dropped delta.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, TypedDict

from coda.errors import BackpressureOverflowError, ErrorCode
from coda.finish import FINISH_REASON_VERSION, FinishReason, Usage
from coda.lifecycle import State
from coda.stops import STOP_RULE_VERSION
from coda.wakeup import CHANNEL, Observer, WakeChannel

if TYPE_CHECKING:
    from coda.reasoning import ReasoningSplit
    from coda.stops import StopHit


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


# -- the last delta's tokens at a stop (S3, K2) ---------------------------------------------
# A stop string can end the text inside a token (stop "ragon" after " dragon": the text ends
# " d"), so the tokens the final delta carries may hold bytes the text does not.
# ``cut_to_text`` keeps their bytes up to the text's end: the token the stop cut keeps its part
# before the stop; tokens wholly past it are the stop's own: the terminal's trailing tokens,
# never reported (S3, like EOS). A token goes with the delta that sends its LAST byte
# (coda.output), so where the stop starts inside a token whose first bytes a delta already
# sent, no delta is left for it: it is cut the same way and reported from the terminal
# (``Terminal.trailing_shown``). So the logprob entries reassemble the text, and every
# selected token is still in a delta or the terminal.


def shown_piece(t: TokenInfo, skip_special: bool) -> bytes:
    """The bytes ``t`` adds to the text: none for a special token the request skips (its bytes
    are a removed span, K2); what its logprob entry shows."""
    return b"" if skip_special and t.special else t.piece


def shown_bytes(t: TokenInfo, skip_special: bool) -> int:
    """How many bytes ``t`` adds to the text (:func:`shown_piece`)."""
    return len(shown_piece(t, skip_special))


def cut_to_text(tokens: Sequence[TokenInfo], budget: int,
                skip_special: bool) -> tuple[TokenInfo, ...]:
    """``tokens`` with their bytes cut to the first ``budget`` bytes (the text left for them).

    A token without bytes (no logprobs asked, or a skipped special token) is kept while no
    token was cut or dropped; from the first token that does not fit, the rest are dropped."""
    out: list[TokenInfo] = []
    left = max(budget, 0)
    for t in tokens:
        n = shown_bytes(t, skip_special)
        if n <= left:
            out.append(t)
            left -= n
            continue
        if left > 0:
            out.append(replace(t, piece=t.piece[:left]))  # NOTE: the token the stop cut
        break  # NOTE: what follows is the stop's own
    return tuple(out)


def cut_tail(tokens: Sequence[TokenInfo], n: int, skip_special: bool) -> tuple[TokenInfo, ...]:
    """``tokens`` without the last ``n`` bytes their pieces add to the text (K2, K3: a partial
    character the budget cut, removed from the text): every token stays (each was selected and
    is billed), the ones wholly in the removed bytes with none."""
    out = list(tokens)
    for i in range(len(out) - 1, -1, -1):
        k = min(n, shown_bytes(out[i], skip_special))
        if k:
            out[i] = replace(out[i], piece=out[i].piece[:len(out[i].piece) - k])
            n -= k
    return tuple(out)


class PhaseTimes(TypedDict):
    """A terminal's P5 phase times as one group (:meth:`Terminal.timings`): the wire's
    ``coda.timings`` object and the durable log's record; a type only, the values live on the
    terminal."""

    queue_s: float
    prefill_s: float
    decode_s: float
    stop_buffer_s: float
    first_token_s: float | None
    total_s: float


@dataclass(frozen=True)
class Terminal:
    """What the single terminal event says (P1, L4, L6, P5): the one record of how a request
    ended — its state and reason, what it counted (``usage``) and how long each phase took
    (P5, the ``*_s`` fields; network send is measured by the transport)."""

    state: State
    finish_reason: FinishReason
    usage: Usage
    error_code: ErrorCode | None = None
    error_message: str | None = None
    stop: StopHit | None = None
    # P5: seconds in each phase (issue 22: on the terminal itself, no object of their own)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_buffer_s: float = 0.0
    first_token_s: float | None = None  # arrival -> first selected token
    total_s: float = 0.0
    # Tokens selected after the last delta whose bytes never reached a delta (held, EOS, stop).
    trailing_tokens: tuple[TokenInfo, ...] = ()
    # seed 004 (D2): the early-stop decision — committed tokens and the saved upper bound
    early_stop: Mapping[str, object] | None = None
    # K2: an incomplete UTF-8 tail removed under utf8_tail="drop" (empty: nothing removed)
    dropped_tail: bytes = b""
    # L4, S4: the versions of the finish-reason enum and of the stop tie rule in force
    finish_reason_version: int = FINISH_REASON_VERSION
    stop_rule_version: str = STOP_RULE_VERSION
    # P1: the start event's content identity of the model that produced the output
    model_snapshot: str | None = None
    # Issue 23, K2: the reasoning split (removed markers, reasoning byte count, forced close);
    # None when the output had no reasoning block (coda.reasoning)
    reasoning: ReasoningSplit | None = None
    # issue 21, O1: drafted / accepted / rejected tokens and verification steps of a request
    # that speculated (None: it did not); usage counts accepted tokens only
    speculative: Mapping[str, int] | None = None
    # O1, echo: each prompt token after the first, scored in the prefill (a request with
    # ``prompt_logprobs``; empty otherwise): its record as if decoded (coda.engine.core)
    prompt_logprobs: tuple[TokenInfo, ...] = ()
    # S3, K2: the first ``trailing_shown`` trailing tokens are text (cut to it, like the last
    # delta's at a stop): a token whose first bytes a delta sent before a stop string that
    # starts inside it. Reported even when the end is a stop or EOS (coda.server.logprobs).
    trailing_shown: int = 0
    # O1: a chat prediction's ``accepted`` / ``rejected`` tokens against the output's
    # (coda.engine.prediction; None: no prediction), the same with or without drafting
    prediction: Mapping[str, int] | None = None

    def timings(self) -> PhaseTimes:
        """The P5 phase times as one group (``coda.timings`` on the wire, the durable log)."""
        return PhaseTimes(queue_s=self.queue_s, prefill_s=self.prefill_s,
                          decode_s=self.decode_s, stop_buffer_s=self.stop_buffer_s,
                          first_token_s=self.first_token_s, total_s=self.total_s)


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

    @property
    def text(self) -> str:
        # NOTE: deltas always end on a UTF-8 character boundary (the detokenizer emits whole
        # characters and a held stop prefix starts on a lead byte), so this never fails.
        return self.data.decode("utf-8")


class StreamClosed(RuntimeError):
    """An event offered after the terminal (L3); a programming error, never silently dropped."""


class BackpressurePolicy(StrEnum):
    PAUSE = "pause"
    BUFFER = "buffer"


@dataclass(frozen=True)
class BackpressureConfig:
    policy: BackpressurePolicy = BackpressurePolicy.BUFFER
    pause_bytes: int = 64 * 1024
    max_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 < self.pause_bytes <= self.max_bytes:
            raise ValueError("need 0 < pause_bytes <= max_bytes")


DEFAULT_BACKPRESSURE = BackpressureConfig()
"""A stream's policy when its request declares none (frozen: one value shared by all)."""


class RequestStream:
    """Append-only, sequence-numbered event log of one request; thread-safe.

    Producers append with :meth:`start`, :meth:`delta` and :meth:`close`; each append posts
    ``(stream, seq)`` to the one wake-up channel (:mod:`coda.wakeup`) and nothing else runs on
    the producer's thread. Readers take :meth:`events_after`; observers on an event loop are
    woken there (:meth:`subscribe`), a blocking reader waits with :meth:`wait_after`.
    """

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
        self._closed = False
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
            if self._closed:
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

    def close(self, terminal: Terminal) -> StreamEvent:
        """Append the single terminal event (P2). Call it from inside the lifecycle's
        terminal critical section (L2)."""
        with self._lock:
            if self._closed:
                raise StreamClosed(f"{self.request_id}: second terminal event")
            self._closed = True
            ev = StreamEvent(self.request_id, len(self._events), EventType.TERMINAL,
                             terminal=terminal)
            self._events.append(ev)
            if self._sync_waiters:
                self._appended.notify_all()
        self._channel.post(self, ev.seq, final=True)
        return ev

    def extend(self, events: list[StreamEvent]) -> int:
        """Append copies of another log's events of this request (a durable copy, a stream
        rebuilt from the stream log), skipping those already here (seq at or below
        ``last_seq``); returns how many were appended. One lock acquisition and one wake-up
        for all of them. Each copy is stamped with this stream's clock at append time, like
        every event (the consistent-cut rule of :mod:`coda.reader`). The checks of
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
                if self._closed:
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
                    self._closed = True
                # NOTE: dataclasses.replace would run __init__ (~2 us an event); a frozen
                # dataclass keeps its fields in __dict__, so a re-stamped copy is a dict copy
                copy = object.__new__(StreamEvent)
                copy.__dict__.update(ev.__dict__, request_id=self.request_id, ts=now)
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
        """The L7 ``stream_buffer`` release, after the terminal: live delivery ends. The
        backpressure credit still owed by slow readers is returned (``unacked_bytes`` drops to
        0, so nothing can pause or overflow on this stream again); the observers still
        subscribed (``listeners``) are dropped by the channel once the terminal's wake-up
        reached them (nothing is appended after it). The event log stays: a reader that
        reconnects later still replays it (P3). Returns what it freed, for the trace row (a
        second release frees nothing)."""
        with self._lock:
            if not self._closed:
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
                and not self._closed
                and self._unacked_bytes >= self.backpressure.pause_bytes)

    def text(self) -> str:
        """All delta bytes so far, concatenated in sequence order."""
        with self._lock:
            return b"".join(e.data for e in self._events).decode("utf-8")
