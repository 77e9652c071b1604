"""The corruptions of the trace checker's corpus (issue 20 deliverable 3; the corpus:
:mod:`tests.trace_corpus`): every corruption class generated on one request's rows of a real
trace, and the deterministic sample of up to ``per_class`` sites per class.

Drop a row, duplicate a row, swap two adjacent rows (their payloads; the timestamps stay in
place, so the clock alone cannot give a swap away), tamper a field (an int ±1, a bool flipped,
an enum to another member, a string extended, a timestamp moved before the previous row's).
A class is (operation, row kind) or (swap, kind, kind) or (tamper, kind, field).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from coda import trace as tr
from coda.trace import TraceEvent
from coda.trace_route import AFFINITY, LEAST, ROUTE_REASONS
from coda.trace_rules import CANCEL_CAUSES

STATES = ("CREATED", "QUEUED", "PREFILLING", "DECODING", "DRAINING", "FINISHED",
          "CANCEL_REQUESTED", "CANCELLED", "FAILED")
REASONS = ("eos", "stop_sequence", "grammar_complete", "max_output_tokens", "context_limit",
           "cancelled", "deadline_exceeded", "content_interrupted", "model_error",
           "transport_error", "confidence_stop", "grammar_forced_close")
RESOURCES = ("stream_buffer", "trace_handle", "kv_cache", "batch_slot", "rng_state")
ENUMS: dict[str, tuple[str, ...]] = {
    "from": STATES, "to": STATES, "state": STATES, "reason": REASONS,
    "cause": tuple(sorted(CANCEL_CAUSES)), "resource": RESOURCES,
    "which": ("string", "token_ids"),
}
# NOTE: a route.decided's reason and rule are the router's, not a finish reason
ROUTE_ENUMS: dict[str, tuple[str, ...]] = {"reason": tuple(sorted(ROUTE_REASONS)),
                                           "rule": (LEAST, AFFINITY)}


@dataclass(frozen=True)
class Mutation:
    """One corruption of request ``rid``'s rows: ``op`` at row ``i`` (swap: i and i+1);
    tamper: ``path`` (a field, or ``usage.x`` / ``decision.x``) set to ``value``."""

    op: str
    rid: str
    i: int
    cls: tuple[str, ...]
    path: str = ""
    old: Any = None
    value: Any = None

    def apply(self, rows: list[TraceEvent]) -> list[TraceEvent]:
        out = list(rows)
        if self.op == "drop":
            del out[self.i]
        elif self.op == "dup":
            out.insert(self.i + 1, rows[self.i])
        elif self.op == "swap":
            a, b = rows[self.i], rows[self.i + 1]
            out[self.i] = TraceEvent(b.request_id, b.kind, b.data, a.ts_ns)
            out[self.i + 1] = TraceEvent(a.request_id, a.kind, a.data, b.ts_ns)
        else:
            ev = rows[self.i]
            if self.path == "ts_ns":
                out[self.i] = TraceEvent(ev.request_id, ev.kind, ev.data, self.value)
            else:
                out[self.i] = TraceEvent(ev.request_id, ev.kind,
                                         _set(dict(ev.data), self.path, self.value), ev.ts_ns)
        return out


def _set(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    head, _, rest = path.partition(".")
    data[head] = _set(dict(data[head]), rest, value) if rest else value
    return data


def _tampers(v: Any, name: str, kind: str = "") -> list[Any]:
    """Values a field is tampered to: another member of its enum, or a nearby wrong value."""
    enums = ROUTE_ENUMS if kind == tr.ROUTE_DECIDED else ENUMS
    if name in enums:
        return [m for m in enums[name] if m != v]
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        return [v + 1, v - 1] if v > 0 else [v + 1]
    if isinstance(v, float):
        return [v - 0.5] if name == "logprob" else [v / 2]
    if isinstance(v, str):
        return [v + "x"]
    if v is None:
        return [0]
    if isinstance(v, list):
        return [v[:-1]] if v else []
    return []


def _fields(ev: TraceEvent) -> Iterator[tuple[str, Any]]:
    yield "ts_ns", ev.ts_ns
    for k, v in ev.data.items():
        if isinstance(v, dict):
            for k2, v2 in v.items():
                yield f"{k}.{k2}", v2
        else:
            yield k, v


def mutations(traces: dict[str, list[TraceEvent]]) -> Iterator[Mutation]:
    """Every corruption of every request's rows (before sampling)."""
    for rid, rows in traces.items():
        for i, ev in enumerate(rows):
            yield Mutation("drop", rid, i, ("drop", ev.kind))
            yield Mutation("dup", rid, i, ("dup", ev.kind))
            if i + 1 < len(rows):
                nxt = rows[i + 1]
                if (ev.kind, ev.data) != (nxt.kind, nxt.data):
                    yield Mutation("swap", rid, i, ("swap", ev.kind, nxt.kind))
            for path, old in _fields(ev):
                if path == "ts_ns":
                    if i > 0:
                        yield Mutation("tamper", rid, i, ("tamper", ev.kind, path), path, old,
                                       rows[i - 1].ts_ns - 1)
                    continue
                leaf = path.rsplit(".", 1)[-1]
                for new in _tampers(old, leaf, ev.kind)[:3]:
                    yield Mutation("tamper", rid, i, ("tamper", ev.kind, path), path, old, new)


def sample(all_mutations: list[Mutation], per_class: int, seed: int = 20) -> list[Mutation]:
    """Up to ``per_class`` corruptions per class, spread over requests (deterministic)."""
    by_cls: dict[tuple[str, ...], list[Mutation]] = defaultdict(list)
    for m in all_mutations:
        by_cls[m.cls].append(m)
    rng = random.Random(seed)
    out: list[Mutation] = []
    for cls in sorted(by_cls):
        ms = by_cls[cls]
        by_rid: dict[str, list[Mutation]] = defaultdict(list)
        for m in ms:
            by_rid[m.rid].append(m)
        picked: list[Mutation] = []
        pools = [rng.sample(v, len(v)) for _, v in sorted(by_rid.items())]
        rng.shuffle(pools)
        while len(picked) < per_class and any(pools):
            for pool in pools:
                if pool and len(picked) < per_class:
                    picked.append(pool.pop())
        out.extend(picked)
    return out

