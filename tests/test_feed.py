"""The replica → ingress event feed (issue 12 items 1, 6; SPEC P1, P2, P6), without Ray: the
replica half (:class:`Outbox`) filled from a producer thread while its drain runs, and the
ingress half (:class:`FeedClient`) routing batches to requests and failing them all when the
feed breaks. The Ray path itself is tests/test_scaleout.py."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.durable.codec import decode_batch, encode_batch
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.scaleout.feed import FeedClient, Outbox
from coda.stream import EventType, RequestStream, StreamEvent, TokenInfo
from coda.wakeup import CHANNEL
from tests.conftest import examples

pytestmark = pytest.mark.timeout(60)

_END = Terminal(State.FINISHED, FinishReason.EOS, Usage())


def test_a_feed_message_carries_each_events_merge_key_p3() -> None:
    """P3: a replica writing the log forwards its durable copies with each event's run key
    (what the ingress merges n > 1 choices by, the log's order); a request whose events have
    none (no log) is sent as before. Keys are nanoseconds past 2**53: kept exact."""
    k = time.time_ns()
    keyed = [StreamEvent("r", 0, EventType.START, model="m", merge_key=k),
             StreamEvent("r", 1, EventType.DELTA, b"a", merge_key=k + 1),
             StreamEvent("r", 2, EventType.DELTA, b"b", merge_key=k + 1)]
    plain = [StreamEvent("s", 0, EventType.START, model="m")]
    got = decode_batch(encode_batch([("r", keyed), ("s", plain)]))
    assert [(rid, [(e.seq, e.data, e.merge_key) for e in evs]) for rid, evs in got] == [
        ("r", [(0, b"", k), (1, b"a", k + 1), (2, b"b", k + 1)]), ("s", [(0, b"", None)])]


def _produce(streams: list[RequestStream], schedule: list[int]) -> None:
    """Append a one-token delta to ``streams[k]`` for each k of ``schedule``, then close all."""
    for i, k in enumerate(schedule):
        streams[k % len(streams)].delta(f"t{i}".encode(), (TokenInfo(i, piece=b"t"),))
    for s in streams:
        s.close(_END)


@settings(deadline=None)
@given(n=st.integers(1, 4), schedule=st.lists(st.integers(0, 3), max_size=40))
def test_outbox_forwards_each_event_once_in_order_and_acks_p1_p2_p6(
        n: int, schedule: list[int]) -> None:
    """For any interleaving of appends on a producer thread while the drain runs, the
    batches give every request exactly its stream's events, in seq order, one terminal
    (P1, P2); each stream is acknowledged through its terminal once handed over (P6)."""
    async def main() -> tuple[list[RequestStream], dict[str, list[StreamEvent]]]:
        box = Outbox(asyncio.get_running_loop())
        streams = [RequestStream(f"r{k}") for k in range(n)]
        for s in streams:
            s.start("m")
            box.forward(s)
        got: dict[str, list[StreamEvent]] = {s.request_id: [] for s in streams}
        producer = threading.Thread(target=_produce, args=(streams, schedule))
        producer.start()
        gen = box.drain()
        while not all(evs and evs[-1].type is EventType.TERMINAL for evs in got.values()):
            for rid, evs in decode_batch(await gen.__anext__()):
                got[rid].extend(evs)
        producer.join()
        # NOTE: a batch is acknowledged when the consumer asks for the next one (Ray resumes
        # the generator once it took the item); nothing more comes
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(gen.__anext__(), 0.05)
        return streams, got

    streams, got = asyncio.run(main())
    for s in streams:
        want = s.events_after(-1)
        assert [(e.seq, e.type, e.data, e.tokens) for e in got[s.request_id]] == [
            (e.seq, e.type, e.data, e.tokens) for e in want]
        assert s.unacked_bytes == 0


class _Steps:
    """An engine as the outbox sees it: a ``stepping`` flag and its step ends posted on the
    wake-up channel with itself as the source."""

    stepping = False


def _step(engine: _Steps, n: int, streams: list[RequestStream], pause_s: float) -> None:
    """Step ``n``: one delta per stream, with a pause between appends (the replica's loop
    runs meanwhile), then the step's end."""
    engine.stepping = True
    for s in streams:
        s.delta(f"s{n}".encode(), (TokenInfo(n, piece=b"s"),))
        time.sleep(pause_s)
    engine.stepping = False
    CHANNEL.post(engine, n)


@settings(deadline=None, max_examples=examples(10))
@given(n=st.integers(2, 5), steps=st.integers(1, 6), pause_ms=st.sampled_from([0.0, 1.0, 3.0]))
def test_one_feed_message_per_engine_step_with_every_request_p1_p6(
        n: int, steps: int, pause_ms: float) -> None:
    """Issue 24 item 2 (P1, P6): with the streams' step source given (the engine; for
    durable copies the log's mirror), the outbox sends one message per engine step carrying that step's delta of every request — even when the replica's loop
    runs between the step's appends — and every event once, in order; what was appended
    while no step ran (the starts) is sent at once."""
    async def main() -> list[list[tuple[str, list[int]]]]:
        engine = _Steps()
        box = Outbox(asyncio.get_running_loop())
        streams = [RequestStream(f"r{k}") for k in range(n)]
        for s in streams:
            s.start("m")
            box.forward(s, steps=engine)
        gen = box.drain()
        messages = [[(rid, [e.seq for e in evs]) for rid, evs in
                     decode_batch(await asyncio.wait_for(gen.__anext__(), 10))]]
        for k in range(1, steps + 1):
            producer = threading.Thread(target=_step, args=(engine, k, streams, pause_ms / 1e3))
            producer.start()
            messages.append([(rid, [e.seq for e in evs]) for rid, evs in
                             decode_batch(await asyncio.wait_for(gen.__anext__(), 10))])
            producer.join()
        with pytest.raises(TimeoutError):  # NOTE: nothing is left over
            await asyncio.wait_for(gen.__anext__(), 0.05)
        await gen.aclose()
        return messages

    messages = asyncio.run(main())
    rids = [f"r{k}" for k in range(n)]
    assert messages == [[(rid, [k]) for rid in rids] for k in range(steps + 1)]


def test_a_late_dispatch_still_sends_the_step_that_ended_p1() -> None:
    """Issue 24 item 2 (P1): the previous step's end, a step's appends, its end and the start
    of the next step all posted before the replica's loop dispatches once (it calls the
    engine's older entry first): the ended step is still sent then, not held until the next
    step ends."""
    async def main() -> list[tuple[str, list[int]]]:
        engine = _Steps()
        box = Outbox(asyncio.get_running_loop())
        streams = [RequestStream(f"r{k}") for k in range(3)]
        for s in streams:
            s.start("m")
            box.forward(s, steps=engine)
        gen = box.drain()
        await asyncio.wait_for(gen.__anext__(), 10)  # NOTE: the starts
        CHANNEL.post(engine, 1)  # NOTE: all on the loop, so nothing is dispatched meanwhile
        engine.stepping = True
        for s in streams:
            s.delta(b"x", (TokenInfo(1, piece=b"x"),))
        engine.stepping = False
        CHANNEL.post(engine, 2)
        engine.stepping = True  # NOTE: the next step runs (and does not end here)
        got = [(rid, [e.seq for e in evs])
               for rid, evs in decode_batch(await asyncio.wait_for(gen.__anext__(), 10))]
        await gen.aclose()
        return got

    assert asyncio.run(main()) == [(f"r{k}", [1]) for k in range(3)]


class _FakeReplica:
    """A replica without Ray: ``submit`` runs a scripted request into the outbox of its feed
    id; ``feed`` drains it; ``die`` breaks every open feed (a killed actor)."""

    def __init__(self) -> None:
        self.boxes: dict[str, Outbox] = {}
        self.dead = asyncio.Event()
        self.feeds_opened: list[str] = []

    def _box(self, feed_id: str) -> Outbox:
        return self.boxes.setdefault(feed_id, Outbox(asyncio.get_running_loop()))

    async def submit(self, req: Any, feed_id: str) -> None:
        rid, n_deltas = req
        s = RequestStream(rid)
        s.start("m")
        self._box(feed_id).forward(s)

        def run() -> None:
            for i in range(n_deltas):
                s.delta(b"x", (TokenInfo(i),))
            if n_deltas < 1000:
                s.close(_END)

        threading.Thread(target=run).start()

    async def feed(self, feed_id: str) -> AsyncIterator[bytes]:
        self.feeds_opened.append(feed_id)
        drain = self._box(feed_id).drain()
        nxt = asyncio.ensure_future(drain.__anext__())
        while True:
            dead = asyncio.ensure_future(self.dead.wait())
            done, _ = await asyncio.wait({nxt, dead}, return_when=asyncio.FIRST_COMPLETED)
            if dead in done:
                nxt.cancel()
                raise ConnectionError("replica died")
            dead.cancel()
            yield nxt.result()
            nxt = asyncio.ensure_future(drain.__anext__())


def test_feed_client_routes_batches_and_fails_every_request_when_the_feed_breaks_p1_p2(
) -> None:
    """Requests sharing one feed each get exactly their own events through the terminal;
    when the feed breaks, every request still routed to it sees the error (its caller then
    resubmits or ends it) and the next request opens a fresh feed."""
    async def main() -> tuple[list[list[int]], BaseException | None, _FakeReplica]:
        rep = _FakeReplica()
        client = FeedClient(rep.feed, rep.submit)

        async def collect(rid: str, n: int) -> list[int]:
            return [ev.seq async for evs in client.events((rid, n), rid) for ev in evs]

        done = await asyncio.gather(*(collect(f"a{k}", 5 + k) for k in range(4)))
        err: BaseException | None = None
        stuck = asyncio.ensure_future(collect("forever", 1000))
        await asyncio.sleep(0.05)
        rep.dead.set()
        try:
            await stuck
        except ConnectionError as exc:
            err = exc
        rep.dead.clear()
        await asyncio.sleep(0.1)
        done.append(await collect("after", 3))
        client.close()
        return done, err, rep

    done, err, rep = asyncio.run(main())
    assert done == [list(range(7 + k)) for k in range(4)] + [list(range(5))]
    assert isinstance(err, ConnectionError)
    assert len(set(rep.feeds_opened)) == 2  # NOTE: a new feed id after the failure
