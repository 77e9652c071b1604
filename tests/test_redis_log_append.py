"""The stream log's append path (issue 24 item 1; SPEC P1, P2, P3): the script runs by its
digest and is re-sent with its body when Redis lost it, and the mirror's flush hold gathers
a burst of appends into one round trip. Real ``redis-server``."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import pytest

from coda.durable import append
from coda.durable.mirror import LogMirror
from coda.durable.redis_log import RedisStreamLog
from coda.stream import BackpressureConfig, EventType, RequestStream, StreamEvent, TokenInfo
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


def test_the_mirror_gathers_a_burst_within_its_hold_into_one_round_trip_p1(
        redis_server: RedisServer) -> None:
    """P1 (issue 24 item 1): a mirror with a flush hold writes every event appended within
    the hold after its wake-up — here the start events and one delta on each of eight
    streams, an engine step — in one append call, one run per stream, in seq order."""
    log = _log(redis_server)
    calls: list[list[append.Run]] = []
    inner = log.append_runs

    def counting(batch: list[append.Run]) -> list[tuple[int, int]]:
        calls.append(batch)
        return inner(batch)

    log.append_runs = counting  # type: ignore[method-assign]
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    mirror = LogMirror(log, hold_s=2.0)
    big = BackpressureConfig(pause_bytes=1 << 30, max_bytes=1 << 30)
    streams = [RequestStream(uuid.uuid4().hex, big) for _ in range(8)]
    copies = []
    for s in streams:
        s.start("m")
        copies.append(mirror.watch(s, record_id="", prompt_tokens=1, on_fenced=lambda: None,
                                   loop=loop))
    for s in streams:
        s.delta(b"x", (TokenInfo(1),))
    for c in copies:
        assert c.wait_after(0, timeout=30)
    mirror.flush(0)
    loop.call_soon_threadsafe(loop.stop)
    assert len(calls) == 1
    assert [[e.seq for e in evs] for evs, _ in calls[0]] == [[0, 1]] * 8
    for s, c in zip(streams, copies, strict=True):
        assert [e.seq for e in c.events_after(-1)] == [0, 1]
        assert [e.seq for e in log.read(s.request_id)] == [0, 1]
