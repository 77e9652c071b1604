"""The Redis Streams stream log (issue 12 item 2, 3): idempotent appends, one terminal, leases
with fencing, orphans ended exactly once (SPEC P1, P2, P3, L2, L5, L6). Real ``redis-server``."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.durable.codec import (
    decode_batch,
    decode_event,
    encode_batch,
    encode_event,
    pack_event,
    unpack_events,
)
from coda.durable.redis_log import Fenced, RedisStreamLog
from coda.errors import ErrorCode
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.stops import StopHit
from coda.stream import EventType, StreamEvent, TokenInfo
from tests.redis_support import RedisServer, running_redis

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()

_tokens = st.lists(st.builds(
    TokenInfo, st.integers(0, 50000), st.none() | st.floats(-50, 0),
    st.lists(st.tuples(st.integers(0, 50000), st.floats(-50, 0)), max_size=3).map(tuple),
    piece=st.binary(max_size=6), top_pieces=st.lists(st.binary(max_size=4), max_size=3).map(tuple),
    special=st.booleans()),
    max_size=4).map(tuple)
_terminal = st.builds(
    Terminal, st.sampled_from(list(State)), st.sampled_from(list(FinishReason)),
    st.builds(Usage, *(st.integers(0, 10**6) for _ in range(7))),
    st.none() | st.sampled_from(list(ErrorCode)), st.none() | st.text(max_size=20),
    st.none() | st.builds(StopHit, st.just("string"), st.integers(0, 3), st.text(min_size=1),
                          st.integers(0, 99), st.integers(0, 99)),
    st.floats(0, 9), st.floats(0, 9), st.floats(0, 9), st.floats(0, 9),
    st.none() | st.floats(0, 9), st.floats(0, 9),
    _tokens, st.none() | st.just({"committed_tokens": 3, "saved_upper_bound": 7}),
    speculative=st.none() | st.dictionaries(st.sampled_from(
        ["drafted", "accepted", "rejected", "verify_steps"]), st.integers(0, 999), min_size=1))


@given(data=st.binary(max_size=40), tokens=_tokens, terminal=st.none() | _terminal,
       model=st.none() | st.text(max_size=10), seq=st.integers(0, 10**6),
       snapshot=st.none() | st.text(max_size=10))
def test_codec_round_trips_every_field_p1_p3(data: bytes, tokens: tuple[TokenInfo, ...],
                                              terminal: Terminal | None, model: str | None,
                                              seq: int, snapshot: str | None) -> None:
    """P1/P3: what a resumed reader decodes is the event the producer appended (ts aside)."""
    kind = EventType.TERMINAL if terminal is not None else EventType.DELTA
    ev = StreamEvent("req-x", seq, kind, data, tokens, model=model, model_snapshot=snapshot,
                     terminal=terminal)
    def fields(e: StreamEvent) -> tuple[object, ...]:
        return (e.request_id, e.seq, e.type, e.data, e.tokens, e.model, e.model_snapshot,
                e.terminal)

    assert fields(decode_event(encode_event(ev))) == fields(ev)  # v1 (JSON, still read)
    plain = StreamEvent("req-x", seq + 1, EventType.DELTA, b"z", (TokenInfo(7, piece=b"z"),))
    run = unpack_events("req-x", pack_event(ev) + pack_event(plain))  # v2: a run of two
    assert [fields(e) for e in run] == [fields(ev), fields(plain)]
    batch = decode_batch(encode_batch([("req-x", [ev]), ("req-y", [])]))
    assert [(rid, [fields(e) for e in evs]) for rid, evs in batch] == [
        ("req-x", [fields(ev)]), ("req-y", [])]


def _log(server: RedisServer, **kw: float) -> RedisStreamLog:
    log = RedisStreamLog(server.url, prefix=f"t{uuid.uuid4().hex[:6]}:", **kw)
    log.fence = str(log.r.incr(f"{log.prefix}fence"))
    log.heartbeat()
    return log


def _events(rid: str, n_deltas: int) -> list[StreamEvent]:
    evs = [StreamEvent(rid, 0, EventType.START, model="m")]
    evs += [StreamEvent(rid, i + 1, EventType.DELTA, f"d{i}".encode(), (TokenInfo(i),))
            for i in range(n_deltas)]
    term = Terminal(State.FINISHED, FinishReason.EOS, Usage(selected_tokens=n_deltas))
    return [*evs, StreamEvent(rid, n_deltas + 1, EventType.TERMINAL, terminal=term)]


@given(attempts=st.lists(st.integers(0, 7), min_size=1, max_size=30))
def test_retried_appends_are_idempotent_p2_p3(redis_server: RedisServer,
                                              attempts: list[int]) -> None:
    """P2/P3: any sequence of (re)tried appends leaves exactly the in-order prefix written,
    each event once — oracle: the producer's own list cut at the first gap."""
    log = _log(redis_server)
    rid = uuid.uuid4().hex
    evs = _events(rid, 6)
    log.open(rid, prompt_tokens=3)
    written = -1
    for i in attempts:
        if i > written + 1:
            with pytest.raises(RuntimeError, match="gap"):
                log.append(evs[i])
            continue
        assert log.append(evs[i]) is (i == written + 1)
        written = max(written, i)
    got = log.read(rid)
    assert [(e.seq, e.type, e.data) for e in got] == [(e.seq, e.type, e.data)
                                                      for e in evs[:written + 1]]
    assert [e.seq for e in log.read(rid, 2)] == [e.seq for e in evs[3:written + 1]]


def test_one_terminal_under_racing_writers_p2(redis_server: RedisServer) -> None:
    """P2: eight writers race to end the same request; exactly one terminal is written and
    nothing is accepted after it; the terminal's keys get the retention TTL."""
    log = _log(redis_server, retention_s=600)
    rid = uuid.uuid4().hex
    evs = _events(rid, 2)
    log.open(rid, prompt_tokens=1)
    log.append_many(evs[:3])
    wins: list[bool] = []
    barrier = threading.Barrier(8)

    def race(k: int) -> None:
        term = Terminal(State.CANCELLED, FinishReason.CANCELLED, Usage(selected_tokens=k))
        barrier.wait()
        wins.append(log.append(StreamEvent(rid, 3, EventType.TERMINAL, terminal=term)))

    threads = [threading.Thread(target=race, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(wins) == 1
    assert not log.append(StreamEvent(rid, 4, EventType.DELTA, b"late"))
    got = log.read(rid)
    assert [e.type for e in got].count(EventType.TERMINAL) == 1 and got[-1].seq == 3
    assert 590_000 < log.r.pttl(log._k("log", rid)) <= 600_000
    assert not log.r.sismember(log._open, rid)


def test_orphans_of_an_expired_lease_end_once_and_fence_the_owner_l2_l5_l6(
        redis_server: RedisServer) -> None:
    """L2/L5/L6: a live peer's request is never touched; once its owner's lease expires, two
    reapers racing write one model_error terminal that bills the committed tokens, and the old
    owner's later appends are refused by the fencing token."""
    owner = _log(redis_server, lease_ttl_s=0.4)
    peers = [RedisStreamLog(redis_server.url, prefix=owner.prefix) for _ in range(2)]
    for p in peers:
        p.fence = str(p.r.incr(f"{p.prefix}fence"))
        p.heartbeat()
    rid = uuid.uuid4().hex
    evs = _events(rid, 3)
    owner.open(rid, prompt_tokens=5)
    owner.append_many(evs[:4])  # start + 3 deltas of one token each, no terminal
    assert peers[0].reap_orphans() == 0  # NOTE: the owner's lease is alive
    assert owner.read(rid)[-1].seq == 3
    time.sleep(0.6)  # the owner stops heartbeating (as if SIGKILLed); its lease expires
    counts: list[int] = []
    barrier = threading.Barrier(2)

    def reap(p: RedisStreamLog) -> None:
        barrier.wait()
        counts.append(p.reap_orphans())

    threads = [threading.Thread(target=reap, args=(p,)) for p in peers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(counts) == [0, 1]
    got = owner.read(rid)
    assert [e.seq for e in got] == [0, 1, 2, 3, 4]
    term = got[-1].terminal
    assert term is not None and term.finish_reason is FinishReason.MODEL_ERROR
    assert term.state is State.FAILED and term.error_code is ErrorCode.MODEL_ERROR
    assert (term.usage.prompt_tokens, term.usage.selected_tokens) == (5, 3)
    with pytest.raises(Fenced):
        owner.heartbeat()  # NOTE: a paused owner that comes back is still fenced
        owner.append(StreamEvent(rid, 4, EventType.DELTA, b"zombie"))
    assert owner.terminal(rid) == term


def test_an_orphan_reaped_before_its_start_was_durable_gets_start_then_terminal_p1_p2(
        redis_server: RedisServer) -> None:
    """P1, P2 (issue 24, found at 1,000 streams): an owner that died after opening a request
    but before its start event was durable left an empty log; the reaper writes the start
    event first, then the one model_error terminal, so the log is a stream a reader (and a
    resume from any seq) can hold: seqs 0, 1, nothing billed."""
    owner = _log(redis_server, lease_ttl_s=0.4)
    peer = RedisStreamLog(redis_server.url, prefix=owner.prefix)
    peer.fence = str(peer.r.incr(f"{peer.prefix}fence"))
    peer.heartbeat()
    rid = uuid.uuid4().hex
    owner.open(rid, prompt_tokens=4)
    owner.stop(release=False)  # NOTE: as if SIGKILLed: no heartbeat, the lease lapses
    time.sleep(0.6)
    assert peer.reap_orphans() == 1 and peer.reap_orphans() == 0
    got = peer.read(rid)
    assert [(e.seq, e.type) for e in got] == [(0, EventType.START), (1, EventType.TERMINAL)]
    term = got[-1].terminal
    assert term is not None and term.finish_reason is FinishReason.MODEL_ERROR
    assert (term.usage.prompt_tokens, term.usage.selected_tokens) == (4, 0)
    assert [e.seq for e in peer.read(rid, after_seq=0)] == [1] and peer.terminal(rid) == term


@given(runs=st.lists(st.tuples(st.integers(0, 7), st.integers(1, 4)), min_size=1, max_size=20))
def test_batched_overlapping_appends_write_each_seq_once_p2_p3(
        redis_server: RedisServer, runs: list[tuple[int, int]]) -> None:
    """P2/P3: pipelined runs of events that overlap what is written (a writer retrying after a
    lost reply) write each seq once; a run starting past a gap is refused whole."""
    log = _log(redis_server)
    rid = uuid.uuid4().hex
    evs = _events(rid, 6)
    log.open(rid, prompt_tokens=1)
    written = -1
    for i, k in runs:
        chunk = evs[i:i + k]
        if i > written + 1:
            with pytest.raises(RuntimeError, match="gap"):
                log.append_many(chunk)
            continue
        assert log.append_many(chunk) == [e.seq > written for e in chunk]
        written = max(written, chunk[-1].seq)
    assert [(e.seq, e.type, e.data) for e in log.read(rid)] == [
        (e.seq, e.type, e.data) for e in evs[:written + 1]]
    assert (log.terminal(rid) is not None) is (written == len(evs) - 1)


def _oracle_apply(state: dict[str, list[StreamEvent]], done: set[str],
                  items: list[StreamEvent]) -> tuple[list[bool], bool]:
    """The log's contract, one event at a time (brute force): a seq right after the last is
    written, one at or below it is a duplicate, one past it is a gap (refused), nothing after
    the terminal. Returns the per-event outcomes and whether a gap was refused."""
    out, gap = [], False
    for ev in items:
        log = state.setdefault(ev.request_id, [])
        if ev.request_id in done or ev.seq <= len(log) - 1:
            out.append(False)
        elif ev.seq > len(log):
            gap = True
            out.append(False)
        else:
            log.append(ev)
            out.append(True)
            if ev.type is EventType.TERMINAL:
                done.add(ev.request_id)
    return out, gap


_batch = st.lists(st.tuples(st.integers(0, 1), st.integers(0, 7), st.integers(1, 5)),
                  min_size=1, max_size=4)


@given(batches=st.lists(_batch, min_size=1, max_size=5), cut=st.integers(-1, 7))
def test_multi_event_entries_match_a_per_event_oracle_p1_p2_p3(
        redis_server: RedisServer, batches: list[list[tuple[int, int, int]]], cut: int) -> None:
    """P1/P2/P3 for runs stored as one entry: any sequence of flushes, each carrying runs of
    two requests that repeat, overlap (partly or wholly) and skip ahead of what is written,
    leaves each request's log equal to a per-event oracle of the contract — every seq once,
    in order, no gap, nothing after the one terminal — with the same per-event outcomes; and
    a read or wait after any seq (also one inside a stored run) returns exactly the events
    after it."""
    log = _log(redis_server)
    rids = [uuid.uuid4().hex for _ in range(2)]
    evs = {rid: _events(rid, 5) for rid in rids}  # seqs 0..6, the terminal at 6
    for rid in rids:
        log.open(rid, prompt_tokens=1)
    state: dict[str, list[StreamEvent]] = {}
    done: set[str] = set()
    for batch in batches:
        items = [ev for r, i, k in batch for ev in evs[rids[r]][i:i + k]]
        want, gap = _oracle_apply(state, done, items)
        if gap:
            with pytest.raises(RuntimeError, match="gap"):
                log.append_many(items)
        else:
            assert log.append_many(items) == want
    for rid in rids:
        oracle = state.get(rid, [])
        key = [(e.seq, e.type, e.data, e.tokens) for e in oracle]
        assert [(e.seq, e.type, e.data, e.tokens) for e in log.read(rid)] == key
        assert [e.seq for e in log.read(rid, cut)] == [e.seq for e in oracle[cut + 1:]]
        if cut + 1 < len(oracle):
            assert [e.seq for e in log.wait(rid, cut, 0.01)] == [e.seq for e in oracle[cut + 1:]]
        term = log.terminal(rid)
        assert (term is not None) is (rid in done)
        # NOTE: each seq is stored once: the entries' events add up to the log, no overlap
        entries = log.r.xrange(log._k("log", rid))
        stored = [e.seq for _, f in entries for e in unpack_events(rid, f[b"v2"])]
        assert stored == [e.seq for e in oracle]


@pytest.mark.parametrize("record_first", [True, False])
def test_issue22_a_record_linked_before_or_after_its_terminals_expires_after_the_last_p3(
        redis_server: RedisServer, record_first: bool) -> None:
    """P3 retention (issue 22 step 3): the store links an API record to its requests after
    they were submitted, so a terminal may come before or after the link; in both orders the
    record expires ``retention_s`` after its last request's terminal, never before it (a
    record with a live request has no TTL) and never never (a leaked descriptor)."""
    log = _log(redis_server, retention_s=600)
    rids = [uuid.uuid4().hex for _ in range(2)]
    for rid in rids:
        log.open(rid, prompt_tokens=1)  # NOTE: no record id: the ingress knows none yet
    evs = {rid: _events(rid, 1) for rid in rids}
    rec = log._k("rec", "rec-" + rids[0])
    for rid in rids:
        log.append_many(evs[rid][:-1])
    if record_first:
        log.put_record("rec-" + rids[0], {"handles": rids}, rids)
    log.append(evs[rids[0]][-1])
    if not record_first:
        log.put_record("rec-" + rids[0], {"handles": rids}, rids)
    assert log.r.pttl(rec) == -1  # NOTE: the second request still runs
    log.append(evs[rids[1]][-1])
    assert 590_000 < log.r.pttl(rec) <= 600_000
    assert log.get_record("rec-" + rids[0]) == {"handles": rids}
