"""coda.reader: the one reader of request streams (SPEC P1, P2, P3, P6; issue 11 item 4)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda import reader as rd
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.stream import EventType, RequestStream, StreamEvent
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy
from coda.wakeup import CHANNEL
from tests.conftest import examples

DONE = Terminal(State.FINISHED, FinishReason.EOS, Usage())
T = TypeVar("T")


def stream(*chunks: bytes, closed: bool = False) -> RequestStream:
    s = RequestStream("r")
    s.start("m")
    for c in chunks:
        s.delta(c)
    if closed:
        s.close(DONE)
    return s


def run(aw: Awaitable[T], limit: float = 3.0) -> T:
    """Run one coroutine with a guard, so a reader that never wakes fails instead of hanging."""
    async def guarded() -> T:
        return await asyncio.wait_for(aw, limit)
    return asyncio.run(guarded())


def seqs(batch: list[tuple[int, StreamEvent]] | None) -> list[tuple[int, int]]:
    assert batch is not None
    return [(i, ev.seq) for i, ev in batch]


def listeners_left(s: RequestStream) -> int:
    """Listeners still subscribed at the L7 release (which drops them: a second frees none)."""
    if not s.closed:
        s.close(DONE)
    n = s.release_live()["listeners"]
    assert s.release_live() == {"unacked_bytes": 0, "listeners": 0}
    return n


def test_p3_merge_order_is_ts_then_stream_index_then_seq() -> None:
    def ev(seq: int, ts: float) -> StreamEvent:
        return StreamEvent("r", seq, EventType.DELTA, b"x", ts=ts)
    batch = [(1, ev(0, 1.0)), (0, ev(5, 1.0)), (2, ev(7, 0.5)), (0, ev(2, 1.0)), (1, ev(1, 2.0))]
    assert seqs(rd.merge_order(batch)) == [(2, 7), (0, 2), (0, 5), (1, 0), (1, 1)]


def test_p3_merge_order_takes_the_durable_logs_merge_key_before_the_clock() -> None:
    """P3: events rebuilt from the durable log carry their run's merge key, which orders them
    whatever clock their copy stamped (a front end that read choice 1's log first)."""
    def ev(seq: int, ts: float, key: int) -> StreamEvent:
        return StreamEvent("r", seq, EventType.DELTA, b"x", ts=ts, merge_key=key)
    batch = [(1, ev(0, 1.0, 20)), (1, ev(1, 1.0, 40)), (0, ev(0, 2.0, 10)), (0, ev(1, 2.0, 30))]
    assert seqs(rd.merge_order(batch)) == [(0, 0), (1, 0), (0, 1), (1, 1)]


def test_p3_merge_order_keeps_each_streams_seq_order_p3_l2() -> None:
    """P3, L2: an ingress's copy of a replica's stream holds the replica's events (no key)
    and, when the replica dies, the terminal the ingress wrote to the log (keyed): merged by
    clock, the terminal stays last (by its key it sorted before every delta, so a resume sent
    it first: seen in the fault-matrix test). Keys that disagree with a stream's seqs never
    put a later event of it first either."""
    def ev(seq: int, ts: float, key: int | None = None) -> StreamEvent:
        return StreamEvent("r", seq, EventType.DELTA, b"x", ts=ts, merge_key=key)
    mixed = [(0, ev(5, 1.0)), (0, ev(6, 2.0)), (0, ev(7, 3.0, key=10**18))]
    assert seqs(rd.merge_order(mixed)) == [(0, 5), (0, 6), (0, 7)]
    skewed = [(0, ev(0, 0.0, 50)), (0, ev(1, 0.0, 20)), (1, ev(0, 0.0, 30)), (1, ev(1, 0.0, 60))]
    assert seqs(rd.merge_order(skewed)) == [(1, 0), (0, 0), (0, 1), (1, 1)]
    near = [(1, ev(0, 0.0, 2**62 + 1)), (0, ev(0, 0.0, 2**62 + 2))]  # NOTE: ints, not floats
    assert seqs(rd.merge_order(near)) == [(1, 0), (0, 0)]
    cross = [(0, ev(0, 1.0)), (0, ev(1, 2.0)), (1, ev(0, 3.0, key=0))]  # NOTE: by clock
    assert seqs(rd.merge_order(cross)) == [(0, 0), (0, 1), (1, 0)]


def test_p3_live_copies_send_every_event_even_keyed_ones_while_a_choice_is_silent() -> None:
    """P3: without a log-ordered copy (live streams, an ingress's copy of a replica's stream
    whose dead replica's terminal the ingress keyed) nothing is held back, not even a keyed
    event while another choice has written nothing yet: the horizon is the log's only."""
    live = [RequestStream("r"), RequestStream("r")]
    keyed = [(0, StreamEvent("r", 0, EventType.TERMINAL, terminal=DONE, merge_key=7))]
    assert rd.settled(keyed, live, [None, None]) == keyed


def test_p3_a_log_ordered_reader_sends_only_what_every_running_log_is_past() -> None:
    """P3: copies a follower fills from the log (``log_ordered``) get each choice's runs when
    their own follower reads them; the reader sends an event only once every running copy
    holds a key at or past it (a closed one, and a log without keys, never hold it back)."""
    def copy(*keys: int) -> RequestStream:
        s = RequestStream("r")
        s.log_ordered = True
        evs = [StreamEvent("r", 0, EventType.START, model="m", merge_key=keys[0])]
        evs += [StreamEvent("r", k + 1, EventType.DELTA, b"x", merge_key=key)
                for k, key in enumerate(keys[1:])]
        s.extend(evs)
        return s

    async def go() -> None:
        a, b = copy(1, 3, 5), copy(2, 4)
        reader = rd.StreamReader([a, b], [-1, -1])
        assert seqs(await reader.next(0.05)) == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert await reader.next(0.05) == []  # NOTE: a's key 5 waits for b's next run
        b.extend([StreamEvent("r", 2, EventType.DELTA, b"x", merge_key=6)])
        assert seqs(await reader.next(0.05)) == [(0, 2)]
        b.extend([StreamEvent("r", 3, EventType.TERMINAL, terminal=DONE, merge_key=7)])
        assert await reader.next(0.05) == []  # NOTE: a, still running, may get a key below 6
        a.extend([StreamEvent("r", 3, EventType.TERMINAL, terminal=DONE, merge_key=8)])
        assert seqs(await reader.next(0.05)) == [(1, 2), (1, 3), (0, 3)]
        assert await reader.next(0.05) is None
        reader.close()
        old = [stream(b"x", b"y"), stream(b"z")]  # NOTE: no keys: merged as read
        for s in old:
            s.log_ordered = True
        assert len(seqs(await rd.StreamReader(old, [-1, -1]).next(0.05))) == 5
        # NOTE: a running choice with nothing in its copy yet holds every other back
        c, e = copy(1, 3), RequestStream("r")
        e.log_ordered = True
        waiting = rd.StreamReader([c, e], [-1, -1])
        assert await waiting.next(0.05) == []
        e.extend([StreamEvent("r", 0, EventType.START, model="m", merge_key=2)])
        assert seqs(await waiting.next(0.05)) == [(0, 0), (1, 0)]
        waiting.close()
        # NOTE: a resume: each copy's event at its cut is the last handed out (its key counts)
        f, g = copy(1, 3, 5), copy(2, 6)
        resumed = rd.StreamReader([f, g], [1, 1])
        assert seqs(await resumed.next(0.05)) == [(0, 2)]
        resumed.close()

    run(go())


@settings(max_examples=examples(100), deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2), st.just(-1)), max_size=30), st.data())
def test_p1_p3_merged_read_is_the_append_order_after_each_position_exactly_once(
        ops: list[int], data: st.DataObject) -> None:
    """For any interleaving of appends (0..2) and reads (-1) over three streams, and any start
    position per stream, the reader delivers every event after its position exactly once, in
    append (= creation time) order, then None once all streams are read through the terminal."""
    streams = [RequestStream(f"r{i}") for i in range(3)]
    appended: list[tuple[int, int]] = []
    def append(i: int) -> None:
        s = streams[i]
        ev = s.start("m") if s.last_seq < 0 else s.delta(b"xy")
        appended.append((i, ev.seq))
    for i in range(3):
        append(i)
    after = [data.draw(st.integers(-1, len(ops) + 2)) for _ in range(3)]
    async def main() -> list[tuple[int, int]]:
        r = rd.StreamReader(streams, after)
        got: list[tuple[int, int]] = []
        for op in ops:
            if op < 0:
                got += seqs(await r.next(timeout=0))
            else:
                append(op)
        for i, s in enumerate(streams):
            appended.append((i, s.close(DONE).seq))
        while (batch := await r.next()) is not None:
            got += seqs(batch)
        assert r.positions == [max(a, s.last_seq) for a, s in zip(after, streams, strict=True)]
        r.close()
        return got
    got = run(main())
    assert got == [(i, q) for i, q in appended if q > after[i]]
    assert all(listeners_left(s) == 0 for s in streams)


def test_p3_a_quiet_open_stream_gives_empty_batches_and_a_closed_one_none() -> None:
    a, b = stream(b"a", closed=True), stream(b"b")
    async def main() -> None:
        r = rd.StreamReader([a, b], [a.last_seq, b.last_seq])
        assert await r.next(timeout=0.05) == []  # b is open: not done
        r.positions[1] = b.last_seq + 4  # past the end of an open stream: still not done
        assert await r.next(timeout=0.05) == []
        b.close(DONE)
        r.positions[1] = -1
        assert len(await r.next() or []) == 3
        assert await r.next() is None  # both read through their terminal
        assert await rd.StreamReader([a], [a.last_seq + 3]).next() is None
    run(main())


def test_p3_waiting_wakes_on_an_append_from_another_thread_or_the_same_loop() -> None:
    s = stream()
    async def main() -> None:
        r = rd.StreamReader([s], [0])
        threading.Timer(0.05, lambda: s.delta(b"t")).start()
        t0 = time.monotonic()
        assert seqs(await r.next(timeout=3)) == [(0, 1)]
        assert time.monotonic() - t0 < 1.5  # woken by the producer, not by the timeout
        async def produce() -> None:
            await asyncio.sleep(0.05)
            s.delta(b"l")
        task = asyncio.create_task(produce())
        assert seqs(await r.next(timeout=2)) == [(0, 2)]
        await task
        r.close()
    run(main())
    async def make() -> None:
        rd.StreamReader([s], [-1])  # NOTE: left subscribed; its loop then closes
    worker = threading.Thread(target=lambda: asyncio.run(make()))
    worker.start()
    worker.join()
    assert s.delta(b"x").seq == 3  # the wake-up of a closed loop is not the producer's error


def test_p3_a_reader_sees_events_stamped_after_its_cut_in_a_later_batch() -> None:
    """The consistent cut: an event whose clock reading is not yet past is read later."""
    class Skewed(RequestStream):
        def events_after(self, seq: int) -> list[StreamEvent]:
            return [dataclasses.replace(e, ts=e.ts + 0.1) for e in super().events_after(seq)]
    s = Skewed("r")
    s.start("m")
    async def main() -> list[tuple[int, int]]:
        return seqs(await rd.StreamReader([s], [-1]).next(timeout=2))
    assert run(main()) == [(0, 0)]


def test_p4_interrupt_raises_in_the_waiting_reader_and_in_every_later_next() -> None:
    """The consumer went away: the waiting reader stops at once, also when the interrupt
    races its quiet timeout, and every later next() raises even with events to read."""
    s = stream(b"a")

    async def main() -> None:
        r = rd.StreamReader([s], [s.last_seq])
        waiting = asyncio.create_task(r.next())
        await asyncio.sleep(0.05)
        r.interrupt()
        with pytest.raises(rd.ReaderInterrupted):
            await waiting
        r.positions[0] = -1
        with pytest.raises(rd.ReaderInterrupted):
            await r.next(timeout=0)
        r = rd.StreamReader([s], [s.last_seq])
        waiting = asyncio.create_task(r.next(timeout=0.02))
        await asyncio.sleep(0)
        time.sleep(0.1)  # NOTE: blocks the loop past the reader's deadline
        await asyncio.sleep(0)
        r.interrupt()  # NOTE: the timeout fires before the woken reader runs
        with pytest.raises(rd.ReaderInterrupted):
            await waiting
    run(main())


def test_p6_ack_frees_what_was_read_in_every_stream_and_close_unsubscribes() -> None:
    a, b = stream(b"abc"), stream(b"q")
    async def main() -> None:
        b.subscribe(lambda _seq: None)  # NOTE: another observer of b, left subscribed
        r = rd.StreamReader([a, b], [-1, -1])
        await r.next()
        a.delta(b"zz")  # appended, not read: still owed after the ack
        assert b.unacked_bytes == 1
        r.ack()  # b was read up to its delta (seq 1): acknowledged too
        assert (a.unacked_bytes, b.unacked_bytes) == (2, 0)
        r.close()
    run(main())
    assert CHANNEL.num_subscribed(b) == 1  # the reader left; only the other observer is left
    # NOTE: its loop is closed: the terminal's wake-up cannot reach it, so the channel drops it
    assert listeners_left(a) == 0 and listeners_left(b) == 0 and CHANNEL.num_subscribed(b) == 0


def test_p3_p6_follow_yields_each_event_after_once_acks_it_and_stops_at_the_terminal() -> None:
    for after in range(-1, 6):
        s = stream(b"a", b"bc")

        async def main(s: RequestStream = s, after: int = after) -> list[int]:
            got: list[int] = []
            async def produce() -> None:
                await asyncio.sleep(0.01)
                s.delta(b"d")
                s.close(DONE)
            task = asyncio.create_task(produce())
            async for ev in rd.follow(s, after):
                assert s.unacked_bytes >= len(ev.data)  # acknowledged once yielded, not before
                got.append(ev.seq)
            await task
            return got

        assert run(main()) == list(range(after + 1, 5))
        assert s.unacked_bytes == (0 if after < 4 else 4)
        assert listeners_left(s) == 0


def test_p3_follow_from_at_or_past_the_terminal_yields_nothing_and_left_early_unsubscribes(
) -> None:
    s = stream(b"a", closed=True)
    async def main() -> None:
        assert [ev async for ev in rd.follow(s, s.last_seq)] == []
        assert [ev async for ev in rd.follow(s, s.last_seq + 7)] == []
        gen = rd.follow(s)
        assert isinstance(gen, AsyncGenerator)
        assert (await gen.__anext__()).seq == 0
        await gen.aclose()
    run(main())
    assert listeners_left(s) == 0


def test_p2_p6_terminal_of_returns_the_terminal_acking_the_stream_while_it_waits() -> None:
    done = stream(b"ab", closed=True)
    assert run(rd.terminal_of(done)) is DONE and done.unacked_bytes == 0
    live = RequestStream("p", BackpressureConfig(BackpressurePolicy.PAUSE, 1, 8))
    live.start("m")
    live.delta(b"c")
    assert live.should_pause
    async def main() -> Terminal:
        waiting = asyncio.create_task(rd.terminal_of(live))
        await asyncio.sleep(0.02)
        assert not live.should_pause  # read and acknowledged while waiting: no stall (P6)
        live.close(DONE)
        return await waiting
    assert run(main()) is DONE
    assert listeners_left(done) == 0 and listeners_left(live) == 0


def test_p2_when_closed_calls_back_exactly_once_and_its_remover_unsubscribes() -> None:
    s = stream(b"a")
    got: list[Terminal] = []
    t = stream()
    never: list[Terminal] = []
    async def main() -> None:
        rd.when_closed(s, got.append)
        assert got == []
        s.delta(b"b")
        await asyncio.sleep(0.01)
        assert got == []
        s.close(DONE)
        for _ in range(3):
            await asyncio.sleep(0)
        assert got == [DONE]
        already: list[Terminal] = []
        rd.when_closed(s, already.append)
        assert already == [DONE]
        rd.when_closed(t, never.append)()
        t.close(DONE)
        await asyncio.sleep(0.01)
    run(main())
    assert got == [DONE] and listeners_left(s) == 0
    assert never == [] and listeners_left(t) == 0


def test_p2_when_closed_fires_once_when_the_stream_closes_while_subscribing() -> None:
    class ClosesOnSubscribe(RequestStream):
        def subscribe(self, callback: Callable[[int], None],
                      loop: asyncio.AbstractEventLoop | None = None) -> Callable[[], None]:
            remove = super().subscribe(callback, loop)
            self.close(DONE)  # NOTE: another thread's close, between subscribe and check
            return remove
    s = ClosesOnSubscribe("r")
    got: list[Terminal] = []
    async def main() -> None:
        rd.when_closed(s, got.append)
        await asyncio.sleep(0.01)  # NOTE: the close's wake-up arrives after the check fired
    run(main())
    assert got == [DONE]


def test_p2_issue22_observers_run_on_the_loop_not_on_the_producers_thread() -> None:
    """Issue 22 step 4: the producer (here a thread standing in for the engine's) only
    appends; ``when_closed`` (metrics) and a ``StreamReader``'s wake-up run on the event loop's
    thread. Before the one wake-up channel, ``when_closed`` called back on the producer's."""
    s = stream()
    threads: list[int] = []
    async def main() -> int:
        closed = asyncio.Event()
        def on_close(_t: Terminal) -> None:
            threads.append(threading.get_ident())
            closed.set()
        rd.when_closed(s, on_close)
        reader = rd.StreamReader([s], [0])
        producer = threading.Thread(target=lambda: (s.delta(b"x"), s.close(DONE)))
        producer.start()
        got = []
        while (batch := await reader.next()) is not None:
            got += [ev.seq for _, ev in batch]
        reader.close()
        await asyncio.wait_for(closed.wait(), 3)
        producer.join()
        assert got == [1, 2]
        return threading.get_ident()
    loop_thread = run(main())
    assert threads == [loop_thread]


def test_p2_wait_terminal_blocks_without_a_loop_until_another_thread_closes() -> None:
    """The blocking Python API (``handle.wait``): no event loop, woken by the stream itself."""
    s = stream(b"a")
    assert rd.wait_terminal(s, 0.01) is None
    threading.Timer(0.05, lambda: s.close(DONE)).start()
    assert rd.wait_terminal(s, 5) is DONE


def test_p3_stream_reading_events_and_result_read_the_handles_stream() -> None:
    class Handle(rd.StreamReading):
        def __init__(self, s: RequestStream) -> None:
            self.stream = s
    h = Handle(stream(b"a", closed=True))
    async def main() -> tuple[list[int], Terminal]:
        return [ev.seq async for ev in h.events(0)], await h.result()
    assert run(main()) == ([1, 2], DONE)


def test_p3_logged_until_waits_for_the_position_rechecking_after_every_append() -> None:
    """P3: a resume ahead of a live log waits in ``logged_until`` until ``ready()`` holds,
    re-checked after each append to any of its streams (another thread's too; no busy wait), returns at
    once when it already holds, and leaves no listener behind either way."""
    a, b = stream(), stream()
    checks: list[int] = []

    def ready() -> bool:
        if not checks:  # NOTE: the producer starts after the first check, however loaded
            for delay, s, data in ((0.05, a, b"x"), (0.15, b, b"y"), (0.25, a, b"z")):
                threading.Timer(delay, s.delta, (data,)).start()
        checks.append(a.last_seq + b.last_seq)
        return a.last_seq >= 2 and b.last_seq >= 1

    async def main() -> list[int]:
        await rd.logged_until([a, b], ready)
        return [CHANNEL.num_subscribed(s) for s in (a, b)]  # NOTE: while the loop lives
    assert run(main()) == [0, 0]
    assert checks[0] == 0 and checks[-1] == 3 and 2 <= len(checks) <= 4, checks  # no spin
    assert run(rd.logged_until([a], lambda: True)) is None
    assert listeners_left(a) == 0 and listeners_left(b) == 0
