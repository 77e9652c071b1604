"""The stream log's append path (issue 24 item 1; SPEC P1, P2, P3): the script runs by its
digest and is re-sent with its body when Redis lost it, and the mirror's flush hold gathers
a burst of appends into one round trip. Real ``redis-server``."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from coda.durable import append
from coda.durable.mirror import LogMirror
from coda.durable.redis_log import RedisStreamLog
from coda.reader import merge_order
from coda.stream import EventType, RequestStream, StreamEvent, TokenInfo
from coda.stream_backpressure import BackpressureConfig
from coda.wakeup import CHANNEL
from tests.redis_support import RedisServer, running_redis

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _log(server: RedisServer) -> RedisStreamLog:
    log = RedisStreamLog(server.url, prefix=f"t{uuid.uuid4().hex[:6]}:")
    log.fence = str(log.r.incr(f"{log.prefix}fence"))
    log.heartbeat()
    return log


def _deltas(rid: str, first: int, n: int) -> list[StreamEvent]:
    return [StreamEvent(rid, s, EventType.DELTA, b"d%d" % s, (TokenInfo(s),))
            for s in range(first, first + n)]


def test_a_flushed_script_cache_is_answered_with_the_body_each_seq_once_p1_p2(
        redis_server: RedisServer) -> None:
    """P1/P2: appends go by the script's digest (``EVALSHA``); after Redis lost its script
    cache (a restart; here ``SCRIPT FLUSH``) every call of a flush — several, past
    ``RUNS_PER_CALL`` runs — is answered ``NOSCRIPT`` and sent again with the body, and each
    event is written exactly once, with the same outcomes as without the flush."""
    log = _log(redis_server)
    rids = [uuid.uuid4().hex for _ in range(append.RUNS_PER_CALL + 3)]
    for rid in rids:
        log.open(rid, prompt_tokens=1)
    first = [(StreamEvent(rid, 0, EventType.START, model="m"), None) for rid in rids]
    assert log.append_batch(first) == [True] * len(rids)
    log.r.script_flush()
    # NOTE: each request's run overlaps what is written by one event (a retried flush)
    items = [(ev, None) for rid in rids
             for ev in [StreamEvent(rid, 0, EventType.START, model="m"), *_deltas(rid, 1, 2)]]
    assert log.append_batch(items) == [False, True, True] * len(rids)
    assert log.r.script_exists(append._EVALSHA.split(b"\r\n")[3].decode()) == [True]
    assert log.append_batch([(ev, None) for rid in rids for ev in _deltas(rid, 2, 2)]) == [
        False, True] * len(rids)
    for rid in rids:
        assert [e.seq for e in log.read(rid)] == [0, 1, 2, 3]
        entries = log.r.xrange(log._k("log", rid))
        assert [int(f[b"a"]) for _, f in entries] == [0, 1, 3]  # NOTE: each seq stored once



def _count_appends(log: RedisStreamLog) -> list[list[append.Run]]:
    """Every batch ``log`` appends from now on, in order (the calls still go through)."""
    calls: list[list[append.Run]] = []
    inner = log.append_runs

    def counting(batch: list[append.Run], first_key: int | None = None
                 ) -> list[tuple[int, int]]:
        calls.append(batch)
        return inner(batch, first_key)

    log.append_runs = counting  # type: ignore[method-assign]
    return calls


def _running_loop() -> asyncio.AbstractEventLoop:
    """An event loop running on its own daemon thread (the observers' loop)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop

def _watch_started(mirror: LogMirror, streams: list[RequestStream],
                   loop: asyncio.AbstractEventLoop) -> list[Any]:
    """Each stream started and watched by ``mirror`` (no record, one prompt token): the
    copies the mirror fills, in ``streams``' order."""
    copies = []
    for s in streams:
        s.start("m")
        copies.append(mirror.watch(s, record_id="", prompt_tokens=1, on_fenced=lambda: None,
                                   loop=loop))
    return copies


def _mirror_one_delta(log: Any, streams: list[RequestStream], hold_s: float,
                      copied: int) -> list[Any]:
    """``streams`` started under a new mirror of ``log`` holding ``hold_s``, one delta each,
    every copy past seq ``copied``, the mirror flushed and its loop stopped: the copies."""
    loop = _running_loop()
    mirror = LogMirror(log, hold_s=hold_s)
    copies = _watch_started(mirror, streams, loop)
    for s in streams:
        s.delta(b"x", (TokenInfo(1),))
    for c in copies:
        assert c.wait_after(copied, timeout=30)
    mirror.flush(0)
    loop.call_soon_threadsafe(loop.stop)
    return copies


def test_the_mirror_gathers_a_burst_within_its_hold_into_one_round_trip_p1(
        redis_server: RedisServer) -> None:
    """P1 (issue 24 item 1): a mirror with a flush hold writes every event appended within
    the hold after its wake-up — here the start events and one delta on each of eight
    streams, an engine step — in one append call, one run per stream, in seq order."""
    log = _log(redis_server)
    calls = _count_appends(log)
    big = BackpressureConfig(pause_bytes=1 << 30, max_bytes=1 << 30)
    streams = [RequestStream(uuid.uuid4().hex, big) for _ in range(8)]
    copies = _mirror_one_delta(log, streams, 2.0, 0)
    assert len(calls) == 1
    assert [[e.seq for e in evs] for evs, _ in calls[0]] == [[0, 1]] * 8
    for s, c in zip(streams, copies, strict=True):
        assert [e.seq for e in c.events_after(-1)] == [0, 1]
        assert [e.seq for e in log.read(s.request_id)] == [0, 1]


class _Steps:
    """An engine as the mirror sees it: ``stepping``, and its step ends on the channel."""

    stepping = False


def test_the_mirror_flushes_once_per_engine_step_given_the_engine_p1(
        redis_server: RedisServer) -> None:
    """P1 (issue 24 item 1): a mirror given the engine's steps writes a step's burst — one
    delta on each of six streams, appended with pauses while the observers' loop runs —
    in one append call at the step's end, without any hold; its copies' burst is marked
    (``stepping``) and its end posted with the mirror as the source (what a replica's feed
    waits for)."""
    log = _log(redis_server)
    calls = _count_appends(log)
    loop = _running_loop()
    engine = _Steps()
    mirror = LogMirror(log, hold_s=0.0, steps=engine)
    ends: list[int] = []
    CHANNEL.subscribe(mirror, ends.append, loop)
    big = BackpressureConfig(pause_bytes=1 << 30, max_bytes=1 << 30)
    streams = [RequestStream(uuid.uuid4().hex, big) for _ in range(6)]
    copies = _watch_started(mirror, streams, loop)
    for c in copies:
        assert c.wait_after(-1, timeout=30)
    before = len(calls)
    engine.stepping = True
    for s in streams:
        s.delta(b"x", (TokenInfo(1),))
        time.sleep(0.01)  # NOTE: the loop observes the appends one by one meanwhile
    time.sleep(0.05)
    assert len(calls) == before  # NOTE: nothing flushed while the step runs
    engine.stepping = False
    CHANNEL.post(engine, 1)
    for c in copies:
        assert c.wait_after(0, timeout=30)
    mirror.flush(0)
    assert [[e.seq for e in evs] for evs, _ in calls[before]] == [[1]] * 6
    assert len(calls) == before + 1
    deadline = time.monotonic() + 30
    while not ends and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(ends) >= 1 and not mirror.stepping
    loop.call_soon_threadsafe(loop.stop)


def test_a_late_dispatch_still_flushes_the_step_that_ended_p1(
        redis_server: RedisServer) -> None:
    """P1 (issue 24 item 1): when the observers' loop comes late — the previous step's end,
    this step's appends, its end and the start of the next step all posted before one
    dispatch, which calls the engine's older entry first — the ended step is still flushed
    then, not held until the next step ends."""
    log = _log(redis_server)
    loop = _running_loop()
    engine = _Steps()
    mirror = LogMirror(log, hold_s=0.0, steps=engine)
    big = BackpressureConfig(pause_bytes=1 << 30, max_bytes=1 << 30)
    streams = [RequestStream(uuid.uuid4().hex, big) for _ in range(3)]
    copies = [mirror.watch(s, record_id="", prompt_tokens=1, on_fenced=lambda: None,
                           loop=loop) for s in streams]
    for s in streams:
        s.start("m")
    for c in copies:
        assert c.wait_after(-1, timeout=30)
    blocked, release = threading.Event(), threading.Event()

    def block() -> None:
        blocked.set()
        release.wait(30)

    loop.call_soon_threadsafe(block)  # NOTE: the loop dispatches nothing meanwhile
    assert blocked.wait(30)
    CHANNEL.post(engine, 1)  # NOTE: the previous step's end, not yet dispatched
    engine.stepping = True
    for s in streams:
        s.delta(b"x", (TokenInfo(1),))
    engine.stepping = False
    CHANNEL.post(engine, 2)
    engine.stepping = True  # NOTE: the next step runs (and does not end in this test)
    release.set()
    for c in copies:
        assert c.wait_after(0, timeout=30)
    assert [[e.seq for e in c.events_after(-1)] for c in copies] == [[0, 1]] * 3
    engine.stepping = False
    mirror.flush(0)
    loop.call_soon_threadsafe(loop.stop)


def test_p3_copies_carry_the_merge_keys_the_log_holds_also_after_a_lost_reply(
        redis_server: RedisServer) -> None:
    """P3 (n > 1 merge order): the mirror's first append of three streams is written but its
    reply is lost (the call raises); the retry, which also carries a delta appended since,
    finds the start and first delta written. Every copy a client reads holds the merge keys
    the log holds (read back for the written part), so the live merge equals the merge of
    the log any other front end rebuilds, event for event."""
    log = _log(redis_server)
    inner = log.append_runs
    big = BackpressureConfig(pause_bytes=1 << 30, max_bytes=1 << 30)
    streams = [RequestStream(uuid.uuid4().hex, big) for _ in range(3)]
    lost = [0]

    def losing(batch: list[append.Run], first_key: int | None = None
               ) -> list[tuple[int, int]]:
        out = inner(batch, first_key)
        if not lost[0]:
            lost[0] = 1
            for s in streams:
                s.delta(b"late", (TokenInfo(2),))
            raise redis.ConnectionError("injected: the reply was lost")
        return out

    log.append_runs = losing  # type: ignore[method-assign]
    copies = _mirror_one_delta(log, streams, 0.2, 1)
    assert lost[0]
    stored = [log.read(s.request_id) for s in streams]
    for c, evs in zip(copies, stored, strict=True):
        assert [(e.seq, e.merge_key) for e in c.events_after(-1)] == [
            (e.seq, e.merge_key) for e in evs]
        assert [e.seq for e in evs] == [0, 1, 2] and evs[0].merge_key is not None
    live = merge_order((i, e) for i, c in enumerate(copies) for e in c.events_after(-1))
    rebuilt = merge_order((i, e) for i, evs in enumerate(stored) for e in evs)
    assert [(i, e.seq) for i, e in live] == [(i, e.seq) for i, e in rebuilt]
    # NOTE: the copies were appended in key order, so a live reader's clock cut (coda.reader)
    # never takes a later key before an earlier one
    stamps = [e.ts for _, e in live]
    assert stamps == sorted(stamps)
