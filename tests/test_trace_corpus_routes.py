"""The trace checker on a replica's trace (issue 24 item 4, SPEC O2; issue 20 deliverable 3):
``tests/data/replica_trace.jsonl`` is replica 0's ``--trace`` file of a real
``coda serve --replicas 2`` run (``scripts/trace_replicas.py``), each request opened by the
``route.decided`` row that brought it there. The corruption corpus kills every
non-equivalent corruption of it, each checked with another request of the file
(:func:`tests.trace_corpus.witnesses`), and each rule over a whole routed trace rejects its
hand-made corruption of the real file.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from coda import trace as tr
from coda.trace import TraceEvent, check_trace
from tests.conftest import examples
from tests.trace_corpus import (
    ALLOWED,
    REPLICA,
    load,
    mutations,
    run_corpus,
    verdict,
    witnesses,
)

TRACES = load(REPLICA)
ROWS = [e for rows in TRACES.values() for e in rows]


def test_o2_the_real_replica_trace_is_sound_and_routed_onto_one_replica() -> None:
    assert check_trace(ROWS) == []
    assert len(TRACES) >= 5
    for rows in TRACES.values():
        assert rows[0].kind == tr.ROUTE_DECIDED and rows[0].data["replica"] == 0
        assert rows[0].ts_ns <= rows[1].ts_ns


def test_o1_o2_corpus_kills_every_non_equivalent_corruption_of_a_replica_trace() -> None:
    rep = run_corpus(TRACES, per_class=12)
    assert rep.survivors == [], rep.survivors
    assert rep.false_alarms == [], rep.false_alarms
    assert rep.kill_rate == 1.0 and rep.by_rule["O2"] > 0
    assert {"route-rule", "replica-count"} <= set(rep.by_allow)


_ALL = list(mutations(TRACES))
_CONTEXT = witnesses(TRACES)


@settings(deadline=None, max_examples=examples(200))
@given(st.integers(0, len(_ALL) - 1))
def test_o2_property_any_corruption_of_a_replica_trace_is_rejected_or_allowed(k: int) -> None:
    m = _ALL[k]
    allowed = any(a.match(m, TRACES[m.rid]) for a in ALLOWED)
    assert bool(verdict(m, TRACES, _CONTEXT)) is not allowed, (m, allowed)


def _with(rid: str, rows: list[TraceEvent]) -> list[TraceEvent]:
    """The real file with request ``rid``'s rows replaced by ``rows``."""
    return [e for r, old in TRACES.items() for e in (rows if r == rid else old)]


def _problems(rid: str, rows: list[TraceEvent], needle: str) -> None:
    got = check_trace(_with(rid, rows))
    assert any(needle in p and ": O2: " in p and p.startswith(rid) for p in got), got


RID = sorted(TRACES, key=lambda r: len(TRACES[r]))[0]
FIRST = TRACES[RID]


def test_o2_a_request_without_its_decision_in_a_routed_trace_is_rejected() -> None:
    """A replica opens every request with its decision: one without, among routed ones."""
    _problems(RID, FIRST[1:], "no route.decided, while")
    assert check_trace(FIRST[1:]) == []  # NOTE: alone, an engine's trace without a router


def test_o2_a_request_routed_onto_another_replica_than_the_file_s_is_rejected() -> None:
    """One replica's file: a decision naming replica 1 (by affinity: the loads allow it)."""
    route = replace(FIRST[0], data={**FIRST[0].data, "replica": 1,
                                    "reason": "prefix_affinity"})
    _problems(RID, [route, *FIRST[1:]], "decided onto replica 1, while")
    assert check_trace([route, *FIRST[1:]]) == []  # NOTE: alone: replica 1's own request


def test_o2_the_engine_reading_the_clock_before_the_decision_is_rejected() -> None:
    late = replace(FIRST[0], ts_ns=FIRST[1].ts_ns + 1)
    _problems(RID, [late, *FIRST[1:]], "reads the clock before the decision")
    # NOTE: a retry decided before the earlier decision's clock (the ingress's merged trace
    # is sorted by time)
    retry = replace(FIRST[0], ts_ns=FIRST[0].ts_ns - 1, data={
        **FIRST[0].data, "reason": "retry_after_failure", "rule": "prefix_affinity",
        "resubmitted_from": [1]})
    first = replace(FIRST[0], data={**FIRST[0].data, "replica": 1})
    _problems(RID, [first, retry, *FIRST[1:]], "before the decision before it")
    assert check_trace([first, replace(retry, ts_ns=FIRST[0].ts_ns), *FIRST[1:]]) == []


def test_o2_retry_fields_on_a_first_decision_are_rejected() -> None:
    """``rule`` and ``resubmitted_from`` are written on a retry only."""
    for extra in ({"resubmitted_from": [1]}, {"rule": "prefix_affinity"}):
        route = replace(FIRST[0], data={**FIRST[0].data, **extra})
        _problems(RID, [route, *FIRST[1:]], "names the rule or replicas of a retry")
