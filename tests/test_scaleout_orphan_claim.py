"""An ingress dies while its submit to a replica is still in flight (SPEC P4, L2, L5; issue 12
item 3; docs/scale-out.md "Who writes the log when there are replicas"): the session's two
replicas (conftest ``replicas``), one redis-server for the module, no HTTP.

Found in the faults-under-load run (``tests/test_scaleout_faults.py``): chats with the default
``on_disconnect=cancel`` started through front end B just before B was SIGKILLed ended
``FAILED`` (``model_error``): B had opened them in the log (owner B), no replica had claimed
them yet, and once B's lease was gone a reaper ended them as it ends any orphan. Here the
ingress's submit is held back (the call in flight) while its lease is dropped and a peer
reaps; then it is let through, so the replica's claim comes after the reaper's terminal."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from coda.durable.redis_log import RedisStreamLog  # noqa: E402
from coda.engine.types import GenerationRequest  # noqa: E402
from coda.finish import FinishReason  # noqa: E402
from coda.lifecycle import State  # noqa: E402
from coda.sampling import SamplingParams  # noqa: E402
from coda.stream import EventType  # noqa: E402
from tests.redis_support import RedisServer, running_redis  # noqa: E402
from tests.scaleout_support import wait_for  # noqa: E402

pytestmark = pytest.mark.timeout(300)
LEASE_S = 2.0


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


class _Held:
    """A replica's Serve handle whose ``submit`` calls wait for ``gate`` (in flight)."""

    def __init__(self, handle: Any, gate: threading.Event) -> None:
        self._handle, self._gate = handle, gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    @property
    def submit(self) -> Any:
        real, gate = self._handle.submit, self._gate

        class _Method:
            @staticmethod
            async def remote(*args: Any) -> Any:
                await asyncio.to_thread(gate.wait, 120)
                return await real.remote(*args)

        return _Method


def test_a_cancel_policy_request_reaped_before_any_replica_claimed_it_is_cancelled_p4_l5(
        replicas: Any, redis_server: RedisServer) -> None:
    """P4 ``cancel``, L5, L2: ingress B opens a chat (owner B) and dies (its lease dropped)
    with its submit in flight. The reaper's terminal is ``CANCELLED`` / ``transport_error``
    naming the lost connection (before the fix: ``FAILED`` / ``model_error``); the submit that
    arrives afterwards finds the request ended (the claim is refused), so the replica runs
    nothing; the log holds the start and that one terminal, and B's own copy, settling from
    the log, ends the same way."""
    from coda.scaleout.remote import RemoteEngine
    from coda.server.durable import ServerDurable

    gate = threading.Event()
    b = ServerDurable(redis_server.url, lease_ttl_s=LEASE_S)
    b.log.start()
    engine = RemoteEngine([_Held(r, gate) for r in replicas.replicas], replicas.config,
                          log=b.log)
    peer = RedisStreamLog(redis_server.url, lease_ttl_s=LEASE_S)
    peer.fence = str(peer.r.incr(f"{peer.prefix}fence"))
    peer.heartbeat()
    req = GenerationRequest((5, 6, 7, 8), SamplingParams(temperature=1.0, seed=4,
                                                         ignore_eos=True),
                            max_tokens=40, request_id=f"held-{time.monotonic_ns()}")
    rid = req.request_id or ""

    async def main() -> Any:
        h = engine.submit(req)
        while peer.meta(rid).get("owner") != b.log.server_id:
            await asyncio.sleep(0.02)
        b.log.stop(release=True)  # NOTE: B SIGKILLed: no heartbeat, its lease gone
        while "term" not in peer.meta(rid):  # NOTE: another reaper may get there first
            await asyncio.to_thread(peer.reap_orphans)
            await asyncio.sleep(0.05)
        gate.set()  # NOTE: the submit B sent before dying reaches the replica now
        await asyncio.wait_for(h.result(), timeout=60)
        return h

    try:
        h = asyncio.run(main())
    finally:
        gate.set()
        b.log.stop(release=True)
    evs = peer.read(rid)
    assert [(e.seq, e.type) for e in evs] == [(0, EventType.START), (1, EventType.TERMINAL)]
    term = evs[-1].terminal
    assert term is not None
    assert (term.state, term.finish_reason) == (State.CANCELLED, FinishReason.TRANSPORT_ERROR)
    assert term.error_code is None and "client connection lost" in (term.error_message or "")
    assert term.usage.prompt_tokens == 4 and term.usage.selected_tokens == 0
    meta = peer.meta(rid)
    assert meta["owner"] == b.log.server_id and "via" not in meta  # NOTE: never claimed
    assert not peer.r.sismember(peer._open, rid)
    assert h.stream.terminal is not None and h.stream.terminal.state is State.CANCELLED

    def idle() -> bool:
        st = replicas.stats()
        return bool(st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_blocks)

    wait_for(idle, timeout=60, what="nothing running on the replicas (L7)")


def test_a_detached_request_whose_ingress_died_unclaimed_is_adopted_and_runs_p4_l5(
        replicas: Any, redis_server: RedisServer) -> None:
    """P4 (background / ``continue``: it runs without its connection), L5, L2, "nothing
    accepted is lost": ingress B opens a detached request (owner B, what it asked stored) and
    dies with its submit to a replica still in flight. Front end A (a live
    :class:`~coda.scaleout.remote.RemoteEngine` on the same Redis, its heartbeat reaping)
    adopts it and resubmits it to a replica: the log, read by id as a client reading the stream
    would, runs to FINISHED with every token (before the fix: ``FAILED`` / ``model_error``,
    no token, though no model had run it). B's in-flight submit, let through once A adopted
    it, is refused (the claim expected B's token), and B, settling that failure, follows the
    log to the same end instead of taking the request back from its adopter."""
    from coda.durable.mirror import LogFollower
    from coda.reader import follow
    from coda.scaleout.remote import RemoteEngine
    from coda.server.durable import ServerDurable

    gate = threading.Event()
    b = ServerDurable(redis_server.url, lease_ttl_s=LEASE_S)
    a = ServerDurable(redis_server.url, lease_ttl_s=LEASE_S)
    b.log.start()
    engine_b = RemoteEngine([_Held(r, gate) for r in replicas.replicas], replicas.config,
                            log=b.log)
    RemoteEngine(replicas.replicas, replicas.config, log=a.log)  # NOTE: A's log adopts
    req = GenerationRequest((5, 6, 7, 8), SamplingParams(temperature=1.0, seed=4,
                                                         ignore_eos=True),
                            max_tokens=24, request_id=f"adopt-{time.monotonic_ns()}")
    rid = req.request_id or ""

    async def main() -> tuple[Any, list[Any]]:
        h = engine_b.submit(req)
        engine_b.detach(rid)  # NOTE: background: set before B's pump opens it in the log
        while a.log.meta(rid).get("owner") != b.log.server_id:
            await asyncio.sleep(0.02)
        assert a.log.meta(rid).get("detach") == "1"
        b.log.stop(release=True)  # NOTE: B SIGKILLed: no heartbeat, its lease gone
        a.log.start()  # NOTE: A's reaper now runs every lease / 3
        while "adopted" not in a.log.meta(rid):
            await asyncio.sleep(0.02)
        gate.set()  # NOTE: the submit B sent before dying reaches a replica now
        follower = LogFollower(a.log, rid)  # NOTE: the client, reading the stream by id

        async def read() -> list[Any]:
            return [ev async for ev in follow(follower.stream)]

        seen = await asyncio.wait_for(read(), timeout=120)
        await asyncio.wait_for(h.result(), timeout=60)
        return h, seen

    try:
        h, seen = asyncio.run(main())
    finally:
        gate.set()
        b.log.stop(release=True)
        a.log.stop(release=True)
    evs = a.log.read(rid)
    assert [e.seq for e in evs] == list(range(len(evs)))
    assert [e.type for e in evs].count(EventType.TERMINAL) == 1
    term = evs[-1].terminal
    assert term is not None
    assert (term.state, term.finish_reason) == (State.FINISHED, FinishReason.MAX_OUTPUT_TOKENS)
    assert term.usage.prompt_tokens == 4 and term.usage.selected_tokens == 24
    assert sum(len(e.tokens) for e in evs if e.type is EventType.DELTA) == 24
    assert [(e.seq, e.type) for e in seen] == [(e.seq, e.type) for e in evs]
    meta = a.log.meta(rid)
    assert meta["adopted"] == b.log.server_id and meta["via"] == a.log.server_id
    assert meta["owner"].startswith("replica-")  # NOTE: a replica claimed it from A
    assert a.log.adopted_total == 1
    assert h.stream.terminal is not None and h.stream.terminal.state is State.FINISHED
