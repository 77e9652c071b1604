"""The trace checker's corruption corpus (issue 20 deliverable 3): mutation testing of
:func:`coda.trace.check_trace` on real traces.

From a real trace (``tests/data/faultmix_trace.jsonl``, written by
``scripts/trace_faultmix.py``, or a replica's ``tests/data/replica_trace.jsonl``, written by
``scripts/trace_replicas.py``), every corruption class is generated on one request's rows
(:mod:`tests.trace_mutations`) and sampled at up to ``per_class`` sites, spread over the
requests.

Each corruption must be rejected unless the engine could have written it; those are matched
by an entry of :data:`ALLOWED` (:mod:`tests.trace_corpus_allowed`, with its reason), and the
checker must ACCEPT them (so the allow-list cannot hide a checker that rejects what the
engine writes).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from coda import trace as tr
from coda.trace import TraceEvent, check_trace, read_jsonl
from tests.trace_corpus_allowed import ALLOWED
from tests.trace_mutations import Mutation, mutations, sample

__all__ = ["ALLOWED", "FAULTMIX", "FAULTMIX_ENDINGS", "REPLICA", "Mutation", "Report", "load",
           "mutations", "run_corpus", "verdict", "witnesses"]

FAULTMIX = Path(__file__).parent / "data" / "faultmix_trace.jsonl"
# replica 0's --trace file of a real `coda serve --replicas 2` run (scripts/trace_replicas.py)
REPLICA = Path(__file__).parent / "data" / "replica_trace.jsonl"
# Every ending (terminal state, reason) the fault mix holds; scripts/trace_faultmix.py refuses
# a run that lost one (a regeneration once lost context_limit and the K3 failure)
FAULTMIX_ENDINGS = frozenset({
    ("FINISHED", "eos"), ("FINISHED", "max_output_tokens"), ("FINISHED", "stop_sequence"),
    ("FINISHED", "context_limit"), ("FINISHED", "deadline_exceeded"),
    ("FINISHED", "grammar_forced_close"), ("CANCELLED", "transport_error"),
    ("CANCELLED", "max_output_tokens"),  # an early stop (D6)
    ("FAILED", "model_error"), ("FAILED", "max_output_tokens"),  # K3: decoding_error
})


@dataclass
class Report:
    generated: int = 0
    killed: int = 0
    allowed: int = 0
    survivors: list[str] = field(default_factory=list)    # non-equivalent, accepted
    false_alarms: list[str] = field(default_factory=list)  # allowed, but rejected
    by_allow: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    by_rule: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # first message's
    classes: int = 0

    @property
    def kill_rate(self) -> float:
        target = self.generated - self.allowed
        return self.killed / target if target else 1.0


def load(path: Path = FAULTMIX) -> dict[str, list[TraceEvent]]:
    traces: dict[str, list[TraceEvent]] = defaultdict(list)
    for ev in read_jsonl(path):
        traces[ev.request_id].append(ev)
    return dict(traces)


def describe(m: Mutation, rows: list[TraceEvent]) -> str:
    what = f"{m.path}: {m.old!r} -> {m.value!r}" if m.op == "tamper" else ""
    return f"{m.op} {'/'.join(m.cls[1:])} at row {m.i} of {m.rid} {what}".rstrip()


def witnesses(traces: dict[str, list[TraceEvent]]) -> dict[str, list[TraceEvent]]:
    """Per request, the rows of another request of the same trace that its corruption is
    checked with, so the rules over a whole trace see it in its file (O2: a replica's trace
    routes every request onto one replica): for a routed trace, the shortest other routed
    request (checking with the whole file would cost a pass over it per corruption); none
    for a trace without decisions."""
    routed = sorted((rows for rows in traces.values()
                     if any(e.kind == tr.ROUTE_DECIDED for e in rows)), key=len)[:2]
    return {rid: next((w for w in routed if w[0].request_id != rid), [])
            for rid in traces} if routed else {}


def verdict(m: Mutation, traces: dict[str, list[TraceEvent]],
            context: dict[str, list[TraceEvent]]) -> list[str]:
    """The checker's problems with corruption ``m``, its request among ``context``'s rows."""
    return check_trace([*m.apply(traces[m.rid]), *context.get(m.rid, [])])


def _rule(problem: str) -> str:
    """The rule a checker message names (``... (T1)``, or ``rid: O2: ...``)."""
    named = re.search(r": ([A-Z]\d+): ", problem)
    return named.group(1) if named else problem.rsplit("(", 1)[-1].rstrip(")")


def run_corpus(traces: dict[str, list[TraceEvent]], per_class: int = 6) -> Report:
    """Generate, check and classify the corpus (``per_class`` 0: every corruption)."""
    assert check_trace(ev for rows in traces.values() for ev in rows) == []
    every = list(mutations(traces))
    picked = sample(every, per_class) if per_class else every
    rep = Report(generated=len(picked), classes=len({m.cls for m in picked}))
    context = witnesses(traces)
    for m in picked:
        rows = traces[m.rid]
        allow = next((a for a in ALLOWED if a.match(m, rows)), None)
        problems = verdict(m, traces, context)
        if allow is not None:
            rep.allowed += 1
            rep.by_allow[allow.name] += 1
            if problems:
                rep.false_alarms.append(f"{describe(m, rows)} [{allow.name}]: {problems[0]}")
        elif problems:
            rep.killed += 1
            rep.by_rule[_rule(problems[0])] += 1
        else:
            rep.survivors.append(describe(m, rows))
    return rep
