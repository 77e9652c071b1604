"""Ordered stream: sequence numbers, single terminal, replay, dedupe, backpressure
(P1, P2, P3, P6, L3)."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.protocol import RequestHandle
from coda.errors import BackpressureOverflowError
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.request import RequestRun
from coda.stream import EventType, RequestStream, StreamClosed, StreamEvent
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy
from coda.trace import ListTraceSink
from tests.conftest import examples
from tests.dedupe import Deduper
from tests.wakeup_support import PostLog

DONE = Terminal(State.FINISHED, FinishReason.EOS, Usage())


def test_p1_p2_start_deltas_terminal_in_order() -> None:
    s = RequestStream("r")
    s.start("m")
    s.delta(b"a")
    s.delta(b"b")
    s.close(DONE)
    evs = s.events_after(-1)
    assert [e.seq for e in evs] == [0, 1, 2, 3]
    assert [e.type for e in evs] == [EventType.START, EventType.DELTA, EventType.DELTA,
                                     EventType.TERMINAL]
    assert evs[0].model == "m"


def test_l3_p2_no_delta_and_no_second_terminal_after_terminal() -> None:
    s = RequestStream("r")
    s.start("m")
    s.close(DONE)
    with pytest.raises(StreamClosed):
        s.delta(b"late")
    with pytest.raises(StreamClosed):
        s.close(DONE)
    assert s.last_seq == 1


@settings(deadline=None, max_examples=examples(100))
@given(st.lists(st.binary(min_size=1, max_size=5), max_size=20), st.integers(-1, 25),
       st.randoms())
def test_p3_replay_from_any_seq_and_dedupe(chunks: list[bytes], after: int,
                                           rnd: random.Random) -> None:
    s = RequestStream("r")
    s.start("m")
    for c in chunks:
        s.delta(c)
    s.close(DONE)
    replay = s.events_after(after)
    assert [e.seq for e in replay] == list(range(max(after + 1, 0), len(chunks) + 2))
    # a reconnecting reader sees overlapping, shuffled deliveries; dedupe restores one copy
    full = s.events_after(-1)
    deliveries = full[: len(full) // 2] + full + replay
    rnd.shuffle(deliveries)
    d = Deduper()
    merged = [e for ev in deliveries for e in d.push(ev)]
    assert [e.seq for e in merged] == list(range(len(full)))
    assert b"".join(e.data for e in merged) == b"".join(chunks)


def test_p6_bounded_buffer_overflows_with_its_own_error_and_drops_nothing() -> None:
    s = RequestStream("r", BackpressureConfig(BackpressurePolicy.BUFFER, 4, 8))
    s.start("m")
    s.delta(b"12345")
    with pytest.raises(BackpressureOverflowError):
        s.delta(b"6789")
    # nothing was appended for the refused delta
    assert s.text() == "12345"
    s.ack(1)
    s.delta(b"6789")
    assert s.text() == "123456789"


def test_p6_pause_policy_signals_the_scheduler_until_the_reader_acks() -> None:
    s = RequestStream("r", BackpressureConfig(BackpressurePolicy.PAUSE, 4, 64))
    s.start("m")
    s.delta(b"ab")
    assert not s.should_pause
    s.delta(b"cd")
    assert s.should_pause
    s.ack(s.last_seq)
    assert not s.should_pause and s.unacked_bytes == 0


def test_p2_every_append_posts_its_seq_to_the_channel_and_only_appends_do() -> None:
    """P2 (issue 22 step 4): each append posts ``(stream, seq)`` once, the terminal's marked
    final; an ack posts nothing (no observer runs for it)."""
    posts = PostLog()
    s = RequestStream("r", channel=posts)
    s.start("m")
    s.delta(b"x")
    s.ack(1)
    s.close(DONE)
    assert posts.posts == [(0, False), (1, False), (2, True)]


def test_p1_a_stream_built_for_a_model_opens_with_its_start_event() -> None:
    """P1 (issue 22): a stream built with ``model`` holds its start event (seq 0, the model
    and its content identity) from its first moment, posts nothing (nobody can be subscribed
    yet), refuses a second start, and numbers the next append 1."""
    posts = PostLog()
    s = RequestStream("r", channel=posts, model="m", model_snapshot="sha")
    (ev,) = s.events_after(-1)
    assert (ev.seq, ev.type, ev.model, ev.model_snapshot) == (0, EventType.START, "m", "sha")
    assert s.last_seq == 0 and posts.posts == []
    with pytest.raises(StreamClosed):
        s.start("m")
    assert s.delta(b"x").seq == 1 and posts.posts == [(1, False)]
    assert RequestStream("q").events_after(-1) == []  # NOTE: no model: the producer starts it


def test_p2_observers_run_on_the_loop_thread_never_the_producers() -> None:
    """Issue 22 step 4: a producer on another thread (the engine's) appends; every observer
    call runs on the subscriber's event loop thread, and the last one sees the terminal's seq;
    after the terminal's wake-up the channel holds no subscription of the stream."""
    s = RequestStream("r")
    calls: list[tuple[int, int]] = []

    async def main() -> int:
        done = asyncio.Event()

        def observe(seq: int) -> None:
            calls.append((threading.get_ident(), seq))
            if s.closed:
                done.set()

        s.subscribe(observe)

        def produce() -> None:
            s.start("m")
            for _ in range(50):
                s.delta(b"x")
            s.close(DONE)

        producer = threading.Thread(target=produce)
        producer.start()
        await asyncio.wait_for(done.wait(), 5)
        producer.join()
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert calls and {t for t, _ in calls} == {loop_thread}
    assert calls[-1][1] == s.last_seq == 51
    assert s.release_live()["listeners"] == 0


def test_p3_a_blocking_reader_wakes_without_an_event_loop() -> None:
    """The synchronous Python API (``handle.wait``): ``wait_after`` returns once an event after
    the given seq exists, False after its timeout; no callback runs on the producer's side."""
    s = RequestStream("r")
    s.start("m")
    assert not s.wait_after(0, 0.01)
    threading.Timer(0.05, lambda: s.delta(b"x")).start()
    assert s.wait_after(0, 5) and s.last_seq == 1


def test_p3_replay_after_the_terminal_returns_at_once() -> None:
    """P3 (defect 6): RequestHandle.events(after=n) with n at or past the terminal's sequence
    number yields nothing and returns (it waited for a wake-up that never came); from any
    earlier n it replays up to the terminal, which is last."""
    stream = RequestStream("r")
    run = RequestRun("r", stream, ListTraceSink(), prompt_tokens=1)
    stream.start("m")
    stream.delta(b"ab")
    for s in (State.QUEUED, State.PREFILLING, State.DECODING):
        run.lifecycle.transition(s)
    run.finish(FinishReason.EOS)
    handle = RequestHandle(run, lambda: None)
    last = stream.last_seq

    async def collect(after: int) -> list[int]:
        return [ev.seq async for ev in handle.events(after)]

    async def main() -> dict[int, list[int]]:
        return {n: await asyncio.wait_for(collect(n), 2) for n in (-1, 0, last - 1, last,
                                                                    last + 5)}

    got = asyncio.run(main())
    assert got == {-1: [0, 1, 2], 0: [1, 2], last - 1: [2], last: [], last + 5: []}
    assert last == 2


def test_p6_backpressure_config_bounds() -> None:
    """P6: 0 < pause_bytes <= max_bytes, both ends included, anything else is refused."""
    assert BackpressureConfig(BackpressurePolicy.PAUSE, 1, 1).pause_bytes == 1
    assert BackpressureConfig(BackpressurePolicy.PAUSE, 8, 8).max_bytes == 8
    for pause, most in ((0, 8), (9, 8), (-1, 8)):
        with pytest.raises(ValueError):
            BackpressureConfig(BackpressurePolicy.PAUSE, pause, most)


def test_p1_p2_producer_calls_return_their_events_and_refuse_misuse() -> None:
    """P1, P2: start/delta/close return the event they appended; a second start and an empty
    delta are refused; each append (closing too) posts its seq."""
    posts = PostLog()
    s = RequestStream("r", channel=posts)
    ev = s.start("m")
    assert (ev.seq, ev.type, ev.model) == (0, EventType.START, "m")
    with pytest.raises(StreamClosed):
        s.start("m")
    with pytest.raises(ValueError):
        s.delta(b"")
    d = s.delta(b"hi")
    assert (d.seq, d.type, d.data) == (1, EventType.DELTA, b"hi")
    term = Terminal(State.FINISHED, FinishReason.EOS, Usage(prompt_tokens=1))
    t = s.close(term)
    assert (t.seq, t.type, t.terminal) == (2, EventType.TERMINAL, term)
    assert posts.posts == [(0, False), (1, False), (2, True)]


def test_p6_ack_frees_exactly_the_acknowledged_bytes_once_and_wakes_the_producer() -> None:
    """P6: ack(n) frees the bytes of the deltas up to n not freed before; a repeated or older
    ack frees nothing (the scheduler sees ``should_pause`` drop at its next step)."""
    s = RequestStream("r", BackpressureConfig(BackpressurePolicy.PAUSE, 4, 64))
    s.start("m")
    for chunk in (b"ab", b"cde", b"fghi"):
        s.delta(chunk)
    assert s.unacked_bytes == 9 and s.should_pause
    s.ack(1)
    assert s.unacked_bytes == 7
    s.ack(1)
    s.ack(0)
    assert s.unacked_bytes == 7
    s.ack(2)
    assert s.unacked_bytes == 4 and s.should_pause
    s.ack(3)
    assert s.unacked_bytes == 0 and not s.should_pause


@given(chunks=st.lists(st.binary(min_size=1, max_size=4), max_size=8), closed=st.booleans(),
       cuts=st.lists(st.tuples(st.integers(0, 10), st.integers(1, 4)), max_size=12))
def test_p1_p2_p3_extend_copies_a_log_exactly_whatever_the_retries(
        chunks: list[bytes], closed: bool, cuts: list[tuple[int, int]]) -> None:
    """A copy fed by ``extend`` with any sequence of (re)sent slices of the source log — each
    starting at or before the copy's next seq — ends equal to the source's prefix it was sent
    (every field but the clock, the snapshot included), each seq once; one wake-up per call
    that appended; a slice starting past the next seq is refused as a gap, and nothing is
    accepted after the terminal (P1, P2, P3)."""
    src = RequestStream("r")
    src.start("m", "snap")
    for c in chunks:
        src.delta(c)
    if closed:
        src.close(DONE)
    evs = src.events_after(-1)
    wakes = PostLog()
    copy = RequestStream("r", BackpressureConfig(pause_bytes=1 << 30, max_bytes=1 << 30),
                         channel=wakes)
    calls = 0
    for i, k in cuts:
        part = evs[i:i + k]
        if not part:
            continue
        if part[0].seq > copy.last_seq + 1:
            with pytest.raises(ValueError, match="gap"):
                copy.extend(part)
            continue
        before = copy.last_seq
        assert copy.extend(part) == max(0, part[-1].seq - before)
        calls += part[-1].seq > before
    fields = [(e.seq, e.type, e.data, e.model, e.model_snapshot, e.terminal)
              for e in copy.events_after(-1)]
    assert fields == [(e.seq, e.type, e.data, e.model, e.model_snapshot, e.terminal)
                      for e in evs[:copy.last_seq + 1]]
    assert len(wakes.posts) == calls and copy.closed is (copy.last_seq == len(evs) - 1 and closed)
    if copy.closed:
        with pytest.raises(StreamClosed):
            copy.extend([StreamEvent("r", copy.last_seq + 1, EventType.DELTA, b"x")])


def test_extend_applies_the_appends_checks_p1_p2_g1() -> None:
    """``extend`` refuses what ``start``/``delta``/``close`` refuse (a start that is not seq 0,
    a second start, an empty delta, a delta past the backpressure bound), re-stamps each copy
    with this stream's id and clock, and leaves the log as it was on a refusal (P1, P2, G1)."""
    import time as _time

    ev = StreamEvent
    fresh = RequestStream("dst")
    with pytest.raises(StreamClosed):
        fresh.extend([ev("src", 0, EventType.DELTA, b"x")])  # the first event must be a start
    assert fresh.last_seq == -1
    t0 = _time.monotonic()
    assert fresh.extend([ev("src", 0, EventType.START, model="m", ts=-5.0)]) == 1
    copied = fresh.events_after(-1)[0]
    assert copied.request_id == "dst" and copied.ts >= t0  # this stream's id and clock
    with pytest.raises(StreamClosed):
        fresh.extend([ev("src", 1, EventType.START, model="m")])  # a second start
    with pytest.raises(ValueError, match="empty"):
        fresh.extend([ev("src", 1, EventType.DELTA, b"")])
    small = RequestStream("b", BackpressureConfig(pause_bytes=2, max_bytes=4))
    small.extend([ev("b", 0, EventType.START, model="m"), ev("b", 1, EventType.DELTA, b"abc")])
    with pytest.raises(BackpressureOverflowError):
        small.extend([ev("b", 2, EventType.DELTA, b"de")])
    assert small.last_seq == 1 and not small.closed
    assert small.extend([ev("b", 2, EventType.DELTA, b"d")]) == 1  # 4 bytes: at the bound
    many = RequestStream("c", BackpressureConfig(pause_bytes=2, max_bytes=4))
    many.extend([ev("c", 0, EventType.START, model="m"), ev("c", 1, EventType.DELTA, b"ab"),
                 ev("c", 2, EventType.DELTA, b"cd")])  # the bytes of every delta count
    with pytest.raises(BackpressureOverflowError):
        many.extend([ev("c", 3, EventType.DELTA, b"e")])
    done = RequestStream("d")
    done.start("m")
    done.close(DONE)
    with pytest.raises(StreamClosed, match="after the terminal"):
        done.extend([ev("d", 2, EventType.DELTA, b"x")])  # P2: nothing after the terminal
    assert done.last_seq == 1


def test_p1_p2_extend_skips_what_it_holds_appends_the_rest_and_posts_the_last_seq() -> None:
    """P1, P2, L3: ``extend`` with a resent slice skips the events it already holds and
    appends every later one (not stopping at the first it skips), posts the new last seq once
    (final with the terminal), and after a copied terminal the stream is closed."""
    src = RequestStream("src")
    src.start("m")
    for part in (b"a", b"b", b"c"):
        src.delta(part)
    src.close(DONE)
    log = src.events_after(-1)
    posts = PostLog()
    copy = RequestStream("c", channel=posts)
    assert copy.extend(log[:2]) == 2
    assert copy.extend(log, merge_key=7) == 3  # NOTE: seq 0 and 1 resent first: skipped
    assert [e.seq for e in copy.events_after(-1)] == [0, 1, 2, 3, 4]
    # NOTE: P3: a run's merge key goes on the events that run appended, and on no other
    assert [e.merge_key for e in copy.events_after(-1)] == [None, None, 7, 7, 7]
    assert posts.posts == [(1, False), (4, True)]
    assert copy.closed
    with pytest.raises(StreamClosed):
        copy.delta(b"late")


@pytest.mark.parametrize("append", ["start", "delta", "close", "extend"])
def test_p3_every_kind_of_append_wakes_a_blocking_reader(append: str) -> None:
    """P3: a reader blocked in ``wait_after`` (the synchronous API) is woken by each kind of
    append, not left to its timeout: a 60 s wait returns within 10 s of the append."""
    s = RequestStream("r")
    if append != "start":
        s.start("m")
    after = s.last_seq
    do = {"start": lambda: s.start("m"), "delta": lambda: s.delta(b"x"),
          "close": lambda: s.close(DONE),
          "extend": lambda: s.extend([StreamEvent("r", after + 1, EventType.DELTA, b"y")])}
    woke: list[bool] = []
    reader = threading.Thread(target=lambda: woke.append(s.wait_after(after, 60)))
    reader.start()
    while not s._sync_waiters:  # NOTE: the reader is blocked before the append
        threading.Event().wait(0.005)
    do[append]()
    reader.join(10)
    assert not reader.is_alive() and woke == [True]


def test_p2_a_delta_is_answer_text_unless_marked_reasoning() -> None:
    """P2 (issue 23): a delta appended without ``reasoning`` is the answer's."""
    s = RequestStream("r")
    s.start("m")
    assert s.delta(b"x").reasoning is False
    assert s.delta(b"y", reasoning=True).reasoning is True


def test_p3_two_blocking_readers_each_wake_when_the_other_has_left() -> None:
    """P3: blocking readers are counted, not flagged: with two readers blocked, one leaving (its
    timeout) must not stop the appends from waking the other; a 60 s wait returns within 10 s
    of the append."""
    s = RequestStream("r", model="m")
    woke: list[bool] = []
    stayer = threading.Thread(target=lambda: woke.append(s.wait_after(0, 60)))
    stayer.start()
    while s._sync_waiters < 1:
        threading.Event().wait(0.005)
    assert not s.wait_after(0, 0.2)  # NOTE: the second reader joins, then leaves on timeout
    s.delta(b"x")
    stayer.join(10)
    assert not stayer.is_alive() and woke == [True]


def test_l7_a_second_stream_buffer_release_frees_nothing() -> None:
    """L7: an observer whose loop never ran the terminal's wake-up is still subscribed at the
    release, which counts it once; a second release frees nothing, not the same listener
    again."""
    loop = asyncio.new_event_loop()
    try:
        s = RequestStream("r", model="m")
        s.subscribe(lambda seq: None, loop)
        s.delta(b"abc")
        s.close(DONE)
        assert s.release_live() == {"unacked_bytes": 3, "listeners": 1}
        assert s.release_live() == {"unacked_bytes": 0, "listeners": 0}
    finally:
        loop.close()


def test_p5_terminal_timings_group_its_phase_fields() -> None:
    """P5: the terminal's phase times, grouped for the wire's ``coda.timings`` and the
    durable log, are its own ``*_s`` fields, each under its own name."""
    t = Terminal(State.FINISHED, FinishReason.EOS, Usage(), queue_s=1.0, prefill_s=2.0,
                 decode_s=3.0, stop_buffer_s=4.0, first_token_s=5.0, total_s=6.0)
    assert t.timings() == {"queue_s": 1.0, "prefill_s": 2.0, "decode_s": 3.0,
                           "stop_buffer_s": 4.0, "first_token_s": 5.0, "total_s": 6.0}
    assert Terminal(State.FINISHED, FinishReason.EOS, Usage()).timings()["first_token_s"] is None
