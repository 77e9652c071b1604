"""Racing reapers and a replica's claim of a request whose ingress died (SPEC P2, P4, L2, L5;
issue 12 item 3, docs/scale-out.md "Who writes the log when there are replicas"). Real
``redis-server``, no Ray.

Ingress B opens a request (its lease, its fencing token) and is SIGKILLed before the replica it
routed the request to has claimed it: its lease is gone. Then two reapers (any server on the
same Redis: a peer ingress, the replicas' own heartbeats) and the replica race: the replica
claims the request (:meth:`~coda.durable.redis_log.RedisStreamLog.take`), writes its first
events and, at its orphan watch, its terminal — cancelled for the client that died with B, or,
for a detached request, the end of its run. Every interleaving of their steps (each reaper:
scan, read, script; the replica: claim, first events, watch) is run, and in every one:

- the log ends with exactly one terminal, last, seqs 0..n, nothing left open (P2, L2);
- a cancel-policy request ends ``CANCELLED`` / ``transport_error`` naming the lost connection,
  whoever wrote it (P4 ``cancel``; a disconnect is never a model failure, L5);
- a detached request runs on and ends the replica's way when the replica claimed it (a claim
  between a reaper's read and its script keeps it); else, as no reaper here can adopt it (B
  stored no request), ``FAILED`` / ``transport_error`` naming B (no model ran it, L5; before
  the adoption fix ``model_error``).

The adoption test races two surviving front ends that adopt a detached request B stored (a
fenced takeover, then a resubmit another replica runs) against B's in-flight claim: exactly one
runs it, to ``FINISHED``.

Found in the faults-under-load run: B's cancel-policy chats started just before its kill ended
``FAILED`` (``model_error``), reaped while B still owned them (and, in one interleaving, reaped
after the replica's claim, fencing out the live replica)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from coda.durable.redis_log import Fenced, RedisStreamLog
from coda.errors import ErrorCode
from coda.finish import CancelCause, FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.stream import EventType, StreamEvent, TokenInfo
from tests.redis_support import RedisServer, running_redis
from tests.scaleout_support import assert_ended_for_lost_ingress

pytestmark = pytest.mark.timeout(300)
LEASE_S = 120.0  # NOTE: the live leases outlast the test; B's is deleted (SIGKILL)
STEPS = {"r0": 3, "r1": 3, "replica": 3}


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


class _Actor:
    """One party of an interleaving on its own thread, run one step at a time: ``pause()``
    (called where a step ends) hands control back to the scheduler."""

    def __init__(self, body: Callable[[], Any]) -> None:
        self.body, self.done = body, False
        self.result: Any = None
        self._go, self._paused = threading.Semaphore(0), threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._go.acquire()
        try:
            self.result = self.body()
        finally:
            self.done = True
            self._paused.release()

    def pause(self) -> None:
        self._paused.release()
        self._go.acquire()

    def step(self) -> None:
        if not self.done:
            self._go.release()
            assert self._paused.acquire(timeout=30), "an actor's step hung"

    def finish(self) -> None:
        while not self.done:
            self.step()
        self._thread.join(5)


class _Parties:
    """Ingress B, two reapers and a replica on one prefix; each reaper's real
    ``reap_orphans`` pauses where the reaper goes from its scan to reading the request, and
    from reading it to the script."""

    def __init__(self, url: str,
                 names: tuple[str, ...] = ("ingress-b", "ingress-a", "replica-1", "replica-0")
                 ) -> None:
        prefix = f"race{uuid.uuid4().hex[:6]}:"
        self.b, self.r0, self.r1, self.replica = (
            RedisStreamLog(url, prefix=prefix, lease_ttl_s=LEASE_S, server_id=name)
            for name in names)
        for log in (self.b, self.r0, self.r1, self.replica):
            log.fence = str(log.r.incr(f"{prefix}fence"))
        self.current: dict[str, _Actor] = {}
        for name in ("r0", "r1"):
            self._pausing(name, getattr(self, name))

    def _pausing(self, name: str, log: RedisStreamLog) -> None:
        reap, script, adopt = log.reap, log._reap, log._adopt

        def paused_adopt(**kw: Any) -> Any:
            self.current[name].pause()
            return adopt(**kw)

        setattr(log, "_adopt", paused_adopt)  # noqa: B010

        def paused_reap(rid: str, owner: str) -> bool:
            self.current[name].pause()
            return reap(rid, owner)

        def paused_script(**kw: Any) -> Any:
            self.current[name].pause()
            return script(**kw)

        setattr(log, "reap", paused_reap)  # noqa: B010 - an instance's own method, wrapped
        setattr(log, "_reap", paused_script)  # noqa: B010


def _replica_run(p: _Parties, rid: str, ingress_fence: str, pause: Callable[[], None],
                 replica: RedisStreamLog | None = None) -> bool:
    """The replica: claim (expecting B's token), write the start and a delta, then its orphan
    watch: B's lease is gone, so a detached request runs to its end, any other is cancelled
    (cause disconnect, as :meth:`coda.scaleout.producer.ReplicaLog.check_orphans` does).
    True if it claimed the request. A fenced append stops it (it cancels its local copy).
    ``replica``: another replica's log (a request an adopter resubmitted; its ingress lives)."""
    log = replica or p.replica
    if log.take(rid, ingress_fence)[0] != 1:
        return False  # NOTE: NotOwner: ended (reaped) before the claim
    pause()
    first = [StreamEvent(rid, 0, EventType.START, model="m"),
             StreamEvent(rid, 1, EventType.DELTA, b"a", (TokenInfo(7, piece=b"a"),))]
    if any(isinstance(r, Fenced) for r in log.append_batch([(e, None) for e in first])):
        return True
    pause()
    meta = log.meta(rid)
    gone = not log.r.exists(log._lease(meta["via"]))
    assert gone == (meta["via"] == p.b.server_id), "B's lease is gone, an adopter's is not"
    usage = Usage(prompt_tokens=3, selected_tokens=1, returned_tokens=1, returned_bytes=1)
    term = (Terminal(State.FINISHED, FinishReason.MAX_OUTPUT_TOKENS, usage)
            if "detach" in meta or not gone
            else Terminal(State.CANCELLED, CancelCause.DISCONNECT.finish_reason, usage))
    log.append_batch([(StreamEvent(rid, 2, EventType.TERMINAL, terminal=term), None)])
    return True


def _run(p: _Parties, order: tuple[str, ...], detached: bool) -> None:
    rid = uuid.uuid4().hex
    p.b.heartbeat()
    p.b.open(rid, prompt_tokens=3, detached=detached, ingress=True)
    p.b.r.delete(p.b._lease(p.b.server_id))  # NOTE: B SIGKILLed, its lease deleted
    for log in (p.r0, p.r1, p.replica):
        log.heartbeat()
    actors = {"r0": _Actor(p.r0.reap_orphans), "r1": _Actor(p.r1.reap_orphans)}
    actors["replica"] = _Actor(lambda: _replica_run(p, rid, p.b.fence, actors["replica"].pause))
    p.current.update(actors)
    for name in order:
        actors[name].step()
    for actor in actors.values():
        actor.finish()
    claimed, reaped = actors["replica"].result, actors["r0"].result + actors["r1"].result
    evs = p.b.read(rid)
    where = f"{order} detached={detached}"
    assert [e.seq for e in evs] == list(range(len(evs))), where
    assert [e.type for e in evs].count(EventType.TERMINAL) == 1, where
    term = evs[-1].terminal
    assert term is not None and p.b.meta(rid)["term"] == str(evs[-1].seq), where
    assert not p.b.r.sismember(p.b._open, rid), where
    assert reaped == (0 if claimed else 1), where  # NOTE: a claimed request is the replica's
    if not detached:
        assert (term.state, term.finish_reason) == (State.CANCELLED,
                                                    FinishReason.TRANSPORT_ERROR), (where, term)
        assert claimed or "client connection lost" in (term.error_message or ""), where
    elif claimed:
        assert term.state is State.FINISHED, (where, term)  # NOTE: it ran on
    else:  # NOTE: B stored no request, so none can adopt it: the honest end, no model_error
        assert (term.state, term.finish_reason, term.error_code) == (
            State.FAILED, FinishReason.TRANSPORT_ERROR, ErrorCode.TRANSPORT_ERROR), (where, term)
        assert "ingress-b" in (term.error_message or "") and "adopted" in (
            term.error_message or ""), (where, term)


def _orders(left: dict[str, int] = STEPS) -> Iterator[tuple[str, ...]]:
    """Every interleaving of the parties' steps (9! / (3! 3! 3!) = 1,680)."""
    if not any(left.values()):
        yield ()
        return
    for name, k in left.items():
        if k:
            for rest in _orders({**left, name: k - 1}):
                yield (name, *rest)


@pytest.mark.parametrize("detached", [False, True], ids=["cancel", "detached"])
def test_reapers_racing_a_replica_claim_end_an_orphan_once_by_its_policy_p2_p4_l2_l5(
        redis_server: RedisServer, detached: bool) -> None:
    """P2, P4, L2, L5: every interleaving of two reapers and the replica's claim (module
    docstring): one terminal; a cancel-policy request whose ingress died ends CANCELLED
    (transport_error); a detached one is the replica's once it claimed it."""
    parties = _Parties(redis_server.url)
    for order in _orders():
        _run(parties, order, detached)


def _adopting(p: _Parties, name: str, replica: RedisStreamLog) -> None:
    """Make front end ``name`` (``r0``/``r1``) an adopter: the fenced takeover
    (:meth:`~coda.durable.redis_log.RedisStreamLog.adopt`, the product's), then its resubmit,
    which ``replica`` claims from it and runs to its end (pausing as the replica does)."""
    log: RedisStreamLog = getattr(p, name)

    def adopter(rid: str, meta: dict[bytes, bytes]) -> bool:
        if not log.adopt(rid, meta):
            return False
        assert _replica_run(p, rid, log.fence, p.current[name].pause, replica)
        return True

    log.adopter = adopter


def _run_adoption(p: _Parties, order: tuple[str, ...], idle: RedisStreamLog) -> None:
    rid = uuid.uuid4().hex
    p.b.heartbeat()
    p.b.open(rid, prompt_tokens=3, detached=True, ingress=True, request=b"req", model="m")
    p.b.r.delete(p.b._lease(p.b.server_id))  # NOTE: B SIGKILLed, its lease deleted
    for log in (p.r0, p.r1, p.replica, idle):
        log.heartbeat()
    assert idle.reap_orphans() == 0 and "term" not in idle.meta(rid)  # NOTE: cannot adopt
    actors = {"r0": _Actor(p.r0.reap_orphans), "r1": _Actor(p.r1.reap_orphans)}
    actors["replica"] = _Actor(lambda: _replica_run(p, rid, p.b.fence, actors["replica"].pause))
    p.current.update(actors)
    before = p.r0.adopted_total + p.r1.adopted_total
    for name in order:
        actors[name].step()
    for actor in actors.values():
        actor.finish()
    assert idle.reap_orphans() == 0  # NOTE: still within its grace, or ended
    claimed = actors["replica"].result
    adopted = p.r0.adopted_total + p.r1.adopted_total - before
    evs, meta = p.b.read(rid), p.b.meta(rid)
    where = f"{order}"
    assert [e.seq for e in evs] == list(range(len(evs))), where
    assert [e.type for e in evs].count(EventType.TERMINAL) == 1, where
    term = evs[-1].terminal
    assert term is not None and meta["term"] == str(evs[-1].seq), where
    assert not p.b.r.sismember(p.b._open, rid), where
    assert actors["r0"].result == actors["r1"].result == 0, where  # NOTE: none reaped
    assert int(claimed) + adopted == 1, (where, claimed, adopted)  # NOTE: exactly one runs it
    assert term.state is State.FINISHED, (where, term)  # NOTE: it ran; never a model_error
    assert [e.type for e in evs] == [EventType.START, EventType.DELTA, EventType.TERMINAL], where
    assert (meta.get("adopted") == p.b.server_id) == (adopted == 1), (where, meta)


def test_a_detached_request_whose_ingress_died_unclaimed_is_adopted_once_and_runs_p2_p4_l5(
        redis_server: RedisServer) -> None:
    """P2, P4 (``continue``/background: it runs without its connection), L2, L5, "nothing
    accepted is lost": ingress B opens a detached request with what it asked and dies before a
    replica claimed it. In every interleaving of B's in-flight submit (the replica's claim
    expecting B's token) and two surviving front ends' reapers, each of which adopts it (the
    fenced :data:`~coda.durable.lua.ADOPT`) and resubmits it to another replica: exactly one
    of the three runs it, it ends FINISHED with one terminal, and a reaper that cannot adopt
    (a replica's) leaves it alone within its grace. Before the fix the reapers ended it
    ``FAILED`` / ``model_error``, though no model had run it."""
    parties = _Parties(redis_server.url, ("ingress-b", "ingress-a", "ingress-c", "replica-0"))
    prefix = parties.b.prefix
    second = RedisStreamLog(redis_server.url, prefix=prefix, lease_ttl_s=LEASE_S,
                            server_id="replica-2")
    idle = RedisStreamLog(redis_server.url, prefix=prefix, lease_ttl_s=LEASE_S,
                          server_id="replica-1")
    for log in (second, idle):
        log.fence = str(log.r.incr(f"{prefix}fence"))
    second.heartbeat()
    _adopting(parties, "r0", second)
    _adopting(parties, "r1", second)
    for order in _orders():
        _run_adoption(parties, order, idle)


def test_an_unadopted_detached_orphan_ends_transport_error_after_the_grace_l5(
        redis_server: RedisServer) -> None:
    """L5 (no model failed, so no ``model_error``), L2: a detached request B stored and died
    with, unclaimed, seen only by a reaper that cannot adopt (a replica's): left alone within
    the grace (for a front end to adopt), then ended once, ``FAILED`` / ``transport_error``
    naming B, billing its prompt."""
    prefix = f"grace{uuid.uuid4().hex[:6]}:"
    b, idle = (RedisStreamLog(redis_server.url, prefix=prefix, lease_ttl_s=LEASE_S,
                              server_id=name) for name in ("ingress-b", "replica-1"))
    for log in (b, idle):
        log.fence = str(log.r.incr(f"{prefix}fence"))
        log.heartbeat()
    idle.adopt_grace_ms = 400
    rid = uuid.uuid4().hex
    b.open(rid, prompt_tokens=3, detached=True, ingress=True, request=b"req", model="m")
    b.r.delete(b._lease(b.server_id))  # NOTE: B SIGKILLed
    assert idle.reap_orphans() == 0 and "term" not in idle.meta(rid)
    assert "orphan_ms" in idle.meta(rid)
    time.sleep(0.5)
    assert idle.reap_orphans() == 1 and idle.reap_orphans() == 0
    assert_ended_for_lost_ingress(idle, rid)
