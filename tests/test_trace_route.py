"""``coda trace check`` on routing decisions (issue 24 item 4; SPEC O2): every decision the real
router (:meth:`RemoteEngine.choose`) makes passes :func:`coda.trace_route.check_routes`, and a
decision it could not have made — a least-outstanding pick of a busier replica, a retry onto a
replica that failed the request, a decision after the engine's rows, a second decision that is
not a retry — is reported with rule O2."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams
from coda.scaleout.remote import RemoteEngine
from coda.trace import ROUTE_DECIDED, TraceEvent, check_trace, read_jsonl
from coda.trace_route import check_routes


def _router(loads: list[int]) -> RemoteEngine:
    """The real router's state without replicas (``choose`` reads only these fields)."""
    eng = object.__new__(RemoteEngine)
    eng.replicas = [None] * len(loads)
    eng.config = EngineConfig(default_max_tokens=32)
    eng.outstanding = list(loads)
    eng._affinity = {}
    eng._lock = threading.Lock()
    eng.affinity_slack = 256
    return eng


def _row(data: dict[str, Any], rid: str = "r") -> TraceEvent:
    return TraceEvent(rid, ROUTE_DECIDED, data)


def _req(prompt: tuple[int, ...], budget: int) -> GenerationRequest:
    return GenerationRequest(prompt, SamplingParams(), max_tokens=budget)


loads_st = st.lists(st.integers(0, 600), min_size=2, max_size=5)


@given(loads=loads_st, data=st.data())
def test_every_decision_of_the_router_passes_and_a_busier_pick_fails_o2(
        loads: list[int], data: st.DataObject) -> None:
    """For all loads, failed sets and prompts (some repeated, for prefix affinity): the
    router's decisions (the first, then a retry away from the failed replica, as
    ``RemoteEngine._pump`` writes it) pass; replacing a least-outstanding pick by any
    candidate with more tokens than the least is reported (brute-force oracle: min)."""
    eng = _router(loads)
    prompts = data.draw(st.lists(st.sampled_from([(1, 2), (3,), (4, 5, 6)]), min_size=1,
                                 max_size=4))
    for prompt in prompts:
        req = _req(prompt, data.draw(st.integers(1, 300)))
        pick, route = eng.choose(req, set())
        rows = [_row(route)]
        assert check_routes(rows) == [], route
        if len(loads) > 1 and data.draw(st.booleans()):
            idx, retry = eng.choose(req, {pick})
            rows.append(_row({**retry, "rule": retry["reason"], "reason": "retry_after_failure",
                              "resubmitted_from": [pick]}))
            assert check_routes(rows) == [], rows
        seen = route["outstanding"]
        busier = [i for i in range(len(seen)) if seen[i] > min(seen)]
        if route["reason"] == "least_outstanding_tokens" and busier:
            bad = {**route, "replica": data.draw(st.sampled_from(busier))}
            assert any("least_outstanding_tokens chose" in p for p in check_routes([_row(bad)]))


def test_impossible_decisions_are_reported_o2() -> None:
    ok = {"replica": 1, "reason": "least_outstanding_tokens", "outstanding": [40, 8]}
    assert check_routes([_row(ok)]) == []
    assert check_routes([_row({**ok, "reason": "prefix_affinity", "replica": 0})]) == []
    cases = {
        "is not one of": {**ok, "replica": 2},
        "without a list": {**ok, "outstanding": []},
        "reason 'random' unknown": {**ok, "reason": "random"},
        "which had failed it": {**ok, "reason": "retry_after_failure", "rule":
                                "least_outstanding_tokens", "resubmitted_from": [1]},
        "without the replicas it left": {**ok, "reason": "retry_after_failure",
                                         "rule": "prefix_affinity", "resubmitted_from": []},
        "with rule": {**ok, "reason": "retry_after_failure", "resubmitted_from": [0]},
    }
    for needle, row in cases.items():
        problems = check_routes([_row(row)])
        assert any(needle in p and p.startswith("O2") for p in problems), (needle, problems)
    # NOTE: least_outstanding among the candidates only: replica 0 failed, 1 is the least left
    retry = {"replica": 1, "reason": "retry_after_failure", "rule": "least_outstanding_tokens",
             "resubmitted_from": [0], "outstanding": [0, 50, 60]}
    assert check_routes([_row(ok | {"replica": 0, "outstanding": [0, 9, 9]}),
                         _row(retry)]) == []
    assert any("another candidate had 50" in p
               for p in check_routes([_row({**retry, "replica": 2})]))
    second = check_routes([_row(ok), _row(ok)])
    assert any("not a retry away" in p for p in second)
    late = check_routes([TraceEvent("r", "lifecycle", {"from": "NEW", "to": "QUEUED"}),
                         _row(ok)])
    assert any("after the engine's rows began" in p for p in late)


def test_trace_check_reports_routes_in_a_real_trace(server_checkpoint: Path,
                                                    tmp_path: Path) -> None:
    """``coda trace check`` on a real engine's JSONL trace: the request's rows with its
    decision first are sound (exit 0); with the decision moved after them, or a busier
    least-outstanding pick, the command names O2 and exits 1."""
    import asyncio

    from typer.testing import CliRunner

    from coda.cli import app
    from coda.engine.async_engine import AsyncEngine

    path = tmp_path / "trace.jsonl"
    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
        max_num_seqs=2, trace_path=str(path)))

    async def run() -> str:
        h = engine.submit(_req((5, 6, 7), 4))
        async for _ in h.events():
            pass
        return str(h.request_id)

    with engine:
        rid = asyncio.run(run())
    rows = read_jsonl(path)
    # NOTE: stamped as a replica writes it, before it submits (O2: not after the first row)
    route = TraceEvent(rid, ROUTE_DECIDED, {"replica": 0, "reason": "least_outstanding_tokens",
                                            "outstanding": [3, 9]}, rows[0].ts_ns)
    runner = CliRunner()
    for events, code in (([route, *rows], 0), ([*rows, route], 1),
                         ([replace(route, data={**route.data, "replica": 1}), *rows], 1),
                         ([replace(route, ts_ns=rows[0].ts_ns + 1), *rows], 1)):
        out = tmp_path / "t.jsonl"
        out.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in events))
        res = runner.invoke(app, ["trace", "check", str(out)])
        assert res.exit_code == code, res.output
        assert ("O2" in res.output) == (code == 1)
    assert check_trace(rows) == []
