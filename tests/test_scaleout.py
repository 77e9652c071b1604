"""Engine replicas on Ray Serve (issue 12 items 1, 3, 5; SPEC P1, P2, L2, L5, L6): routing
with prefix affinity, a replica killed before the first frame (resubmitted, same output) and
mid-stream (exactly one model_error terminal, committed tokens billed). One Ray instance per
module, two replicas sharing two cores."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

from coda.engine.types import GenerationRequest  # noqa: E402
from coda.finish import CancelCause, FinishReason  # noqa: E402
from coda.sampling import SamplingParams  # noqa: E402
from coda.stream import EventType  # noqa: E402
from tests.scaleout_support import FaultRow, kill_replica  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def remote(replicas: Any) -> Any:
    """The session's two replicas (conftest), with this module's own routing state."""
    from coda.scaleout.remote import RemoteEngine

    return RemoteEngine(replicas.replicas, replicas.config)


def _req(seed: int, n: int, rid: str) -> GenerationRequest:
    return GenerationRequest((5, 6, 7, 8), SamplingParams(temperature=1.0, seed=seed,
                                                          ignore_eos=True),
                             max_tokens=n, request_id=rid)


async def _run(engine: Any, req: GenerationRequest, kill_after: int | None = None) -> Any:
    h = engine.submit(req)
    if kill_after == 0:
        kill_replica(h.route["replica"] if h.route else 0)
    seen = 0
    async for ev in h.events():
        if ev.type is EventType.DELTA:
            seen += 1
            if kill_after and seen == kill_after:
                kill_replica(h.replica)
    return h


def _ids(h: Any) -> list[int]:
    evs = h.stream.events_after(-1)
    assert [e.seq for e in evs] == list(range(len(evs)))  # P1: no gap, no duplicate
    assert [e.type for e in evs].count(EventType.TERMINAL) == 1  # P2
    return [t.token_id for e in evs for t in e.tokens]


def test_routing_affinity_and_same_seed_same_output_on_both_replicas(remote: Any) -> None:
    """Same seed → same tokens on either replica (what makes a resubmit exact); the second
    request with the same prompt prefix follows it to the same replica, recorded."""
    async def main() -> tuple[Any, Any, list[list[int]]]:
        a = await _run(remote, _req(11, 12, "aff-a"))
        b = await _run(remote, _req(11, 12, "aff-b"))
        outs = []
        for r in remote.replicas:  # the same request sent to each replica directly
            gen = r.options(stream=True, method_name="generate").remote(_req(11, 12, None))
            outs.append([t.token_id async for ev in gen for t in ev.tokens])
        return a, b, outs

    a, b, outs = asyncio.run(main())
    assert outs[0] == outs[1] == _ids(a) == _ids(b)
    assert b.route["replica"] == a.route["replica"] and b.route["reason"] == "prefix_affinity"


def test_replica_killed_mid_stream_and_before_first_frame_l2_l5_l6(remote: Any) -> None:
    """Replica 0 runs two long requests and holds a third in its queue, then is killed: the
    two running end exactly once with model_error billing their committed tokens (L5, L6);
    the queued one, which had no frame yet, is resubmitted to replica 1 and its output equals
    the same request run there from the start (same seed).

    The third is submitted only once both long ones stream (so it must queue), and the kill
    happens only while the ingress still sees both running and the third frameless; a run
    whose timing broke that precondition (a slow machine) is let finish and tried again."""
    remote.affinity_slack = 10**9  # NOTE: all three follow the shared prefix to one replica

    async def attempt(k: int) -> list[Any] | None:
        hs = [remote.submit(_req(30 + j, 500, f"kill-{k}-{j}")) for j in range(2)]
        while any(not h.stream.events_after(0) for h in hs):
            await asyncio.sleep(0.005)  # both running requests have a first frame
        hs.append(remote.submit(_req(32, 16, f"kill-{k}-2")))
        while hs[2].stream.last_seq < 0 and not hs[2].stream.closed:
            await asyncio.sleep(0.002)  # the replica took it (its start event)
        target = hs[0].replica
        held = (all(h.replica == target for h in hs) and hs[2].stream.last_seq == 0
                and not any(h.stream.closed for h in hs))
        if held:
            kill_replica(target)
        for h in hs:
            await h.result()
        return hs if held else None

    async def main() -> tuple[list[Any], Any]:
        for k in range(4):
            hs = await attempt(k)
            if hs is not None:
                break
        assert hs is not None, "precondition (2 running, 1 queued) never held"
        remote.affinity_slack = 256
        ref = await _run(remote, _req(32, 16, "kill-ref"))
        return hs, ref

    before = remote.num_resubmits_total
    hs, ref = asyncio.run(main())
    for h in hs[:2]:
        ids = _ids(h)
        term = h.stream.terminal
        assert term is not None and term.finish_reason is FinishReason.MODEL_ERROR
        assert term.usage.selected_tokens == len(ids) and 1 <= len(ids) < 500
    assert remote.num_resubmits_total == before + 1 and hs[2].replica != hs[0].replica
    assert hs[2].stream.terminal is not None
    assert hs[2].stream.terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert _ids(hs[2]) == _ids(ref)
    row = FaultRow("replica killed: 2 running, 1 queued (no Redis)")
    for h in hs:
        row.add_log(h.stream.events_after(-1))
    row.report()


def test_one_ingress_speaks_the_api_over_replicas_p1(remote: Any) -> None:
    """The HTTP server runs unchanged over the replicas (the Engine seam): the official openai
    client streams and waits through one ingress."""
    import openai

    from coda.server.app import create_app
    from tests.conftest import LiveServer

    live = LiveServer(create_app(remote, manage_engine=False)).start()
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        full = client.chat.completions.create(model=remote.model_name, messages=msgs,
                                              max_tokens=8, seed=4, extra_body={"ignore_eos": True})
        chunks = list(client.chat.completions.create(
            model=remote.model_name, messages=msgs, max_tokens=8, seed=4, stream=True,
            extra_body={"ignore_eos": True}))
        # NOTE: Ollama's /api/show describes the replicas' model (the ingress loads none)
        details = httpx.post(f"{live.url}/api/show", json={"model": remote.model_name}
                             ).json()["details"]
    finally:
        live.stop()
    assert details["family"] and details["parameter_size"], details
    assert full.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content


def test_embeddings_on_either_replica_are_the_same(remote: Any) -> None:
    """Issue 23 item 2 over replicas: the ingress sends embeddings to the replicas in turn;
    both compute the same vector (same weights, one forward each), and bad ids are refused
    with the engine's typed error."""
    from coda.errors import InvalidRequestError

    async def main() -> list[list[float]]:
        return [await remote.embed([5, 6, 7, 8]) for _ in range(4)]

    got = asyncio.run(main())
    assert len(got[0]) > 0 and got == [got[0]] * 4
    with pytest.raises(InvalidRequestError):
        asyncio.run(remote.embed([]))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        asyncio.run(remote.embed([10 ** 9]))


def test_100_streams_30pct_disconnects_nothing_lost_or_leaked_p1_p2_p4_l7(remote: Any) -> None:
    """100 streams over the two replicas through one ingress, 30% of the clients leave early
    (P4 cancel): every stream's log has contiguous seqs and one terminal (P1, P2), every
    complete client saw each event id once, and both replicas end with every KV block free
    (L7)."""
    import httpx

    from coda.server.app import create_app
    from tests.conftest import LiveServer, SSEAccumulator

    app = create_app(remote, manage_engine=False)
    live = LiveServer(app).start()

    async def one(client: httpx.AsyncClient, k: int) -> tuple[bool, list[dict[str, str]]]:
        leave = k % 10 < 3
        body = {"model": remote.model_name, "messages": [{"role": "user", "content": f"q{k}"}],
                "max_tokens": 12, "seed": k, "stream": True, "ignore_eos": True}
        acc, out = SSEAccumulator(), []
        async with client.stream("POST", f"{live.url}/v1/chat/completions", json=body) as r:
            async for line in r.aiter_lines():
                ev = acc.feed(line)
                if ev is not None:
                    out.append(ev)
                    if leave and len(out) >= 2:
                        break
        return leave, out

    async def main() -> list[tuple[bool, list[dict[str, str]]]]:
        sem = asyncio.Semaphore(20)
        async with httpx.AsyncClient(timeout=120) as client:
            async def guarded(k: int) -> tuple[bool, list[dict[str, str]]]:
                async with sem:
                    return await one(client, k)
            return await asyncio.gather(*(guarded(k) for k in range(100)))

    try:
        results = asyncio.run(main())
        deadline = time.monotonic() + 60
        while True:
            st = remote.stats()
            if (st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_blocks
                    and all(r.done for r in app.state.coda.store.records())):
                break
            assert time.monotonic() < deadline, f"not settled: {st}"
            time.sleep(0.2)
        records = app.state.coda.store.records()
    finally:
        live.stop()
    assert len(records) == 100 and sum(leave for leave, _ in results) == 30
    for leave, evs in results:
        if not leave:
            assert evs[-1]["data"] == "[DONE]"
            ids = sorted({int(e["id"]) for e in evs if "id" in e})
            assert ids == list(range(ids[0], ids[-1] + 1))  # each event id, none missing
    row = FaultRow("100 streams over 2 replicas, 30% clients leave (no Redis)")
    for rec in records:
        _ids(rec.handles[0])  # contiguous seqs, exactly one terminal
        row.add_log(rec.handles[0].stream.events_after(-1))
    row.report()


def test_shutdown_ends_in_flight_requests_once_l2(remote: Any) -> None:
    """L2: the ingress's shutdown ends a request running on a replica with one terminal
    (cancelled, cause shutdown) before it returns."""
    async def main() -> Any:
        h = remote.submit(_req(40, 400, "shut"))
        while h.stream.last_seq < 2:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(remote.shutdown, 60)
        assert h.stream.closed
        return h

    h = asyncio.run(main())
    ids = _ids(h)
    assert h.stream.terminal.finish_reason is FinishReason.CANCELLED and len(ids) < 400
    assert not remote.cancel("shut")


def test_a_cancel_that_overtakes_its_submit_still_ends_the_request_c1(remote: Any) -> None:
    """C1 (issue 24, found as late cancels at 1,000 streams): the ingress's submit and cancel
    are two Serve calls with no order between them. A cancel that reaches the replica before
    the request is kept and applied when the request starts there: it ends cancelled, early,
    instead of running to its limit."""
    replica = remote.replicas[0]
    assert replica.cancel.remote("early-1", CancelCause.CLIENT).result(timeout_s=30) is False

    async def main() -> list[Any]:
        gen = replica.options(stream=True, method_name="generate").remote(
            _req(3, 400, "early-1"))
        return [ev async for ev in gen]

    evs = asyncio.run(main())
    term = evs[-1].terminal
    assert term is not None and term.finish_reason is FinishReason.CANCELLED
    assert sum(len(e.tokens) for e in evs) < 400
