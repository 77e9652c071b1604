"""Replicas together with the durable log (issue 12 items 1, 2, 4; SPEC P1–P4, L2, L5, L6,
O2): the replicas write every request's log, a stream resumes on another ingress reading the
same Redis, "the first frame" is the first delta durably appended (seed 004: a replica that
dies with a delta the log never confirmed is resubmitted; one whose delta is durable but never
reached the ingress is final), and the routing decision is a trace row. The session's two
replicas (conftest ``replicas``) and one redis-server for the module."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

from coda.durable.redis_log import RedisStreamLog  # noqa: E402
from coda.engine.types import GenerationRequest  # noqa: E402
from coda.finish import FinishReason  # noqa: E402
from coda.lifecycle import State  # noqa: E402
from coda.sampling import SamplingParams  # noqa: E402
from coda.stream import EventType, StreamEvent  # noqa: E402
from tests.conftest import LiveServer  # noqa: E402
from tests.redis_support import RedisServer, running_redis  # noqa: E402
from tests.scaleout_support import (  # noqa: E402
    FaultRow,
    ingress,
    kill_replica,
    sse_events,
    wait_for,
    wait_replica,
)

pytestmark = pytest.mark.timeout(300)
LEASE_S = 2.0  # NOTE: short, so orphans end quickly; long enough for a loaded 2-core CI box


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


@pytest.fixture(scope="module")
def cluster(replicas: Any) -> Any:
    return replicas


def _engine(cluster: Any, log: Any = None) -> Any:
    """A fresh ingress engine over the module's replicas (its own routing state); with
    ``log`` its replicas write the stream log."""
    from coda.scaleout.remote import RemoteEngine

    return RemoteEngine(cluster.replicas, cluster.config, log=log)


def _ingress(cluster: Any, url: str) -> tuple[LiveServer, Any]:
    return ingress(cluster, url, LEASE_S)


def _chat_text(events: list[dict[str, str]]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events if e["data"] != "[DONE]"
                   for c in json.loads(e["data"])["choices"])


def _log(url: str) -> RedisStreamLog:
    return RedisStreamLog(url, lease_ttl_s=LEASE_S)


def _req(seed: int, n: int, rid: str) -> GenerationRequest:
    return GenerationRequest((5, 6, 7, 8), SamplingParams(temperature=1.0, seed=seed,
                                                          ignore_eos=True),
                             max_tokens=n, request_id=rid)


async def _until(pred: Any, timeout: float = 60.0, what: str = "") -> None:
    """:func:`wait_for` on the event loop (the ingress's pumps keep running)."""
    deadline = time.monotonic() + timeout
    while not await asyncio.to_thread(pred):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


def _same(a: list[StreamEvent], b: list[StreamEvent]) -> bool:
    return [(e.seq, e.type, e.data) for e in a] == [(e.seq, e.type, e.data) for e in b]


def test_replicas_write_the_log_and_any_ingress_resumes_p3_p4(
        cluster: Any, redis_server: RedisServer) -> None:
    """Item 1: with --replicas and --redis-url, each request's log is written by the replica
    that ran it (meta owner); a chat stream resumes on a second ingress with Last-Event-ID
    (/v1/streams/{id}) and a background response with ?stream=true&starting_after=n, every
    remaining event exactly once; the route decision is in the trace API (O2)."""
    a, _ = _ingress(cluster, redis_server.url)
    b, _ = _ingress(cluster, redis_server.url)
    chat = {"model": cluster.model_name, "messages": [{"role": "user", "content": "hello"}],
            "stream": True, "max_tokens": 40, "ignore_eos": True, "seed": 3,
            "on_disconnect": "continue"}
    row = FaultRow("ingress lost, client resumes elsewhere (replicas + Redis)")
    dlog = _log(redis_server.url)
    try:
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{a.url}/v1/chat/completions", json=chat) as resp:
                rid = resp.headers["x-request-id"]
                head = sse_events(resp, stop_after=4)
            last_id = head[-1]["id"]
            with client.stream("GET", f"{b.url}/v1/streams/{rid}",
                               headers={"Last-Event-ID": last_id}) as resp:
                assert resp.status_code == 200
                tail = sse_events(resp)
            with client.stream("GET", f"{b.url}/v1/streams/{rid}") as resp:
                full = sse_events(resp)
            trace = client.get(f"{a.url}/v1/traces/{rid}").json()
            created = client.post(f"{a.url}/v1/responses", json={
                "model": cluster.model_name, "input": "hi", "background": True,
                "max_output_tokens": 30, "ignore_eos": True, "seed": 5}).json()
            with client.stream("GET", f"{a.url}/v1/responses/{created['id']}?stream=true"
                               ) as resp:
                first = sse_events(resp, stop_after=6)
            seen = int(first[-1]["id"])
            with client.stream("GET", f"{b.url}/v1/responses/{created['id']}",
                               params={"stream": "true", "starting_after": seen}) as resp:
                rest = sse_events(resp)
            with client.stream("GET", f"{b.url}/v1/responses/{created['id']}",
                               params={"stream": "true"}) as resp:
                replay = sse_events(resp)
    finally:
        a.stop()
        b.stop()
    assert _chat_text(head) + _chat_text(tail) == _chat_text(full)
    assert tail[-1]["data"] == "[DONE]" and int(tail[0]["id"]) > int(last_id)
    meta = dlog.meta(rid)
    assert meta["owner"].startswith("replica-") and "term" in meta  # the replica wrote it
    evs = dlog.read(rid)
    got = sorted({int(e["id"]) for e in head + tail if "id" in e})
    row.add_log(evs, got)
    assert [e.seq for e in evs] == list(range(len(evs))) and len(evs) == 42  # start+40+term
    assert [e["data"] for e in replay[seen + 1:]] == [e["data"] for e in rest]
    assert [int(e["id"]) for e in replay] == list(range(len(replay)))
    kinds = [e["event"] for e in replay]
    assert sum(k.startswith("response.") and k.split(".")[1] in
               ("completed", "incomplete", "failed") for k in kinds) == 1
    row.add_log(dlog.read(created["id"]))
    row.report()
    routes = [r for r in trace["rows"] if r["kind"] == "route.decided"]
    assert len(routes) == 1 and routes[0]["replica"] in (0, 1)
    assert routes[0]["reason"] in ("least_outstanding_tokens", "prefix_affinity")
    assert len(routes[0]["outstanding"]) == 2
    kinds_t = [r["kind"] for r in trace["rows"]]
    assert kinds_t[0] == "route.decided" and "terminal" in kinds_t  # the replica's rows too


def _pin(engine: Any, replica: int, req: GenerationRequest) -> Any:
    """Submit ``req`` routed to ``replica`` (the other looks busy for this one decision)."""
    other = 1 - replica
    engine.outstanding[other] += 10**6
    try:
        h = engine.submit(req)
    finally:
        engine.outstanding[other] -= 10**6
    assert h.replica == replica
    return h


@pytest.fixture()
def bound(cluster: Any, redis_server: RedisServer) -> Iterator[tuple[Any, RedisStreamLog]]:
    """An ingress engine bound to the log (its own lease), without HTTP."""
    from coda.server.durable import ServerDurable

    d = ServerDurable(redis_server.url, lease_ttl_s=LEASE_S)
    d.log.start()
    engine = _engine(cluster, d.log)
    yield engine, d.log
    d.log.stop(release=True)
    for r in cluster.replicas:
        wait_replica(r)


def test_undurable_delta_is_resubmitted_seed004_l2(bound: tuple[Any, RedisStreamLog],
                                                   cluster: Any) -> None:
    """Seed 004: replica 0 emits deltas but Redis never confirms them (appends fail), then
    dies: no delta is in the log, so the request is resubmitted to replica 1 and its output
    equals the same request run there from the start (same seed); the client saw only what
    the log confirmed. The trace holds both decisions, the second ``retry_after_failure``."""
    engine, dlog = bound
    cluster.replicas[0].inject.remote("fail_appends").result(timeout_s=30)

    async def main() -> tuple[Any, Any]:
        h = _pin(engine, 0, _req(61, 24, "undurable"))
        await _until(lambda: dlog.meta("undurable").get("owner", "").startswith("replica-"),
                  what="the replica's claim")
        await asyncio.sleep(1.0)  # NOTE: deltas exist on the replica, none in the log
        assert h.stream.last_seq < 1 and int(dlog.meta("undurable").get("last", -1)) < 1
        kill_replica(0)
        await h.result()
        ref = _pin(engine, 1, _req(61, 24, "undurable-ref"))
        await ref.result()
        return h, ref

    before = engine.num_resubmits_total
    h, ref = asyncio.run(main())
    assert engine.num_resubmits_total == before + 1 and h.replica == 1
    evs = dlog.read("undurable")
    assert _same(h.stream.events_after(-1), evs)  # the client holds exactly the log
    assert h.stream.terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    ids = [t.token_id for e in evs for t in e.tokens]
    assert ids == [t.token_id for e in ref.stream.events_after(-1) for t in e.tokens]
    assert len(ids) == 24
    rows, _ = engine.trace.rows("undurable")
    routes = [e.data for e in rows if e.kind == "route.decided"]
    assert [r["reason"] for r in routes][-1] == "retry_after_failure"
    assert routes[-1]["replica"] == 1 and routes[-1]["resubmitted_from"] == [0]
    row = FaultRow("replica killed, its deltas never durable (resubmitted)")
    row.add_log(evs, [e.seq for e in h.stream.events_after(-1)])
    row.report()


def test_durable_delta_never_received_is_final_l5_l6(bound: tuple[Any, RedisStreamLog],
                                                     cluster: Any) -> None:
    """Seed 004, the other side: replica 0's deltas reach the log but never the ingress
    (forwarding stalled), then it dies. The first frame happened (it is durable), so the
    request is not resubmitted: it ends once with model_error billing the durable tokens, and
    the client gets every durable delta it had missed, then that terminal."""
    engine, dlog = bound
    cluster.replicas[0].inject.remote("stall_forwarding").result(timeout_s=30)

    async def main() -> Any:
        h = _pin(engine, 0, _req(62, 500, "stalled"))
        await _until(lambda: int(dlog.meta("stalled").get("last", -1)) >= 3,
                  what="three durable deltas")
        assert h.stream.last_seq <= 0  # the ingress received none of them
        kill_replica(0)
        await h.result()
        return h

    before = engine.num_resubmits_total
    h = asyncio.run(main())
    assert engine.num_resubmits_total == before
    evs = dlog.read("stalled")
    assert _same(h.stream.events_after(-1), evs)
    term = h.stream.terminal
    assert term is not None and term.state is State.FAILED
    assert term.finish_reason is FinishReason.MODEL_ERROR
    committed = sum(len(e.tokens) for e in evs if e.type is EventType.DELTA)
    assert term.usage.selected_tokens == committed and 3 <= committed < 500
    row = FaultRow("replica killed after durable deltas the ingress never got (final)")
    row.add_log(evs, [e.seq for e in h.stream.events_after(-1)])
    row.report()


def test_fenced_live_replica_forwards_the_peers_terminal_l2_l5(
        bound: tuple[Any, RedisStreamLog], cluster: Any, redis_server: RedisServer) -> None:
    """Issue 24 (found at 1,000 streams on 2 loaded cores): replica 0 is alive and running a
    request when its lease lapses (here: its lease key deleted) and a peer's reaper ends the
    request (model_error). The replica's next append is fenced out; the ingress still gets
    the one terminal — the log's, forwarded by the replica's copy following the log — and
    holds exactly the log. Before the fix the ingress waited forever for the replica's own
    terminal, which the log refuses."""
    engine, dlog = bound
    peer = RedisStreamLog(redis_server.url, lease_ttl_s=LEASE_S)
    peer.start()

    async def main() -> Any:
        h = _pin(engine, 0, _req(63, 480, "fenced"))
        await _until(lambda: h.stream.last_seq >= 2, what="two deltas at the ingress")
        owner = dlog.meta("fenced")["owner"]
        assert owner.startswith("replica-")
        # NOTE: the replica's heartbeat may put its lease back between the two calls: retry
        reaped = False
        while not reaped and "term" not in dlog.meta("fenced"):
            dlog.r.delete(dlog._lease(owner))
            reaped = peer.reap("fenced", owner)
        assert reaped, "the request ended before the reaper could fence it"
        await asyncio.wait_for(h.result(), timeout=60)
        return h

    try:
        h = asyncio.run(main())
    finally:
        peer.stop()
    evs = dlog.read("fenced")
    term = h.stream.terminal
    assert term is not None and term.finish_reason is FinishReason.MODEL_ERROR
    assert _same(h.stream.events_after(-1), evs)  # the client holds exactly the log
    assert evs[-1].terminal is not None and "lease expired" in evs[-1].terminal.error_message
    row = FaultRow("live replica fenced out by a reaper (its lease lapsed)")
    row.add_log(evs, [e.seq for e in h.stream.events_after(-1)])
    row.report()
    def idle() -> bool:
        st = cluster.stats()
        return bool(st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_blocks)

    wait_for(idle, timeout=60, what="the fenced request's KV blocks freed (L7)")


def test_cancel_through_another_ingress_c1_p2(cluster: Any, redis_server: RedisServer) -> None:
    """C1 across ingresses: a background response made on ingress A is cancelled through
    ingress B, which only knows it from the log (a rebuilt record): the replica running it
    ends it, once, cancelled, and both ingresses then show that one terminal."""
    # NOTE: the fencing test before this one deletes a replica's lease: until its heartbeat
    # puts it back, a reaper may fence this request out (failed, "lease expired"), not cancel it
    # (none held: this test runs alone, no replica is bound to the log yet, nothing to fence)
    dlog = _log(redis_server.url)

    def leases_back() -> bool:
        held = len(dlog.r.keys(dlog._lease("replica-*")))
        return held == 0 or held >= len(cluster.replicas)

    wait_for(leases_back, timeout=60, what="every replica's lease held again")
    a, _ = _ingress(cluster, redis_server.url)
    b, _ = _ingress(cluster, redis_server.url)
    try:
        with httpx.Client(timeout=60) as client:
            rid = client.post(f"{a.url}/v1/responses", json={
                "model": cluster.model_name, "input": "cancel me", "background": True,
                "max_output_tokens": 480, "ignore_eos": True, "seed": 9}).json()["id"]
            got = client.post(f"{b.url}/v1/responses/{rid}/cancel").json()
            wait_for(lambda: client.get(f"{a.url}/v1/responses/{rid}").json()["status"]
                     not in ("queued", "in_progress"), what="ingress A's copy to end")
            seen_a = client.get(f"{a.url}/v1/responses/{rid}").json()
    finally:
        a.stop()
        b.stop()
    assert got["status"] == seen_a["status"] == "cancelled"
    evs = _log(redis_server.url).read(rid)
    assert evs[-1].terminal is not None and evs[-1].terminal.state is State.CANCELLED
    assert got["usage"]["output_tokens"] == sum(len(e.tokens) for e in evs) < 480
    row = FaultRow("cancel through an ingress that did not submit it (replicas + Redis)")
    row.add_log(evs)
    row.report()
