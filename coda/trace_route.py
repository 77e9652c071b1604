"""The trace checker's rules on routing decisions (issue 24 item 4; SPEC O2): the
``route.decided`` rows a replica router (:mod:`coda.scaleout.remote`) writes into a request's
trace — the replica's JSONL trace holds the decision that brought the request there, the
ingress's merged trace (``GET /v1/traces/{id}``) every decision.

Per row: ``replica`` is an index into ``outstanding`` (the output tokens still to produce per
replica when the router decided, all non-negative); ``reason`` is ``least_outstanding_tokens``,
``prefix_affinity`` or ``retry_after_failure`` (then ``rule`` names which of the first two chose
and ``resubmitted_from`` the replicas that failed it, never the chosen one). A
least-outstanding choice is a replica with the fewest outstanding tokens among the candidates
(every replica not in ``resubmitted_from``). Per request: the decisions come before every row
of the engine's (a request is routed before any replica sees it), and each later decision is
a retry away from every replica tried before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from coda import trace as tr

__all__ = ["ROUTE_REASONS", "check_routes"]

LEAST = "least_outstanding_tokens"
AFFINITY = "prefix_affinity"
RETRY = "retry_after_failure"
ROUTE_REASONS = frozenset({LEAST, AFFINITY, RETRY})


def _ints(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        return None
    return value


def _one(data: Any) -> tuple[list[str], int | None]:
    """The problems of one decision, and its replica (None when unreadable)."""
    replica, reason = data.get("replica"), data.get("reason")
    loads = _ints(data.get("outstanding"))
    if loads is None or not loads:
        return ["O2: route.decided without a list of outstanding tokens per replica"], None
    if not isinstance(replica, int) or isinstance(replica, bool) \
            or not 0 <= replica < len(loads):
        return [f"O2: route.decided replica {replica!r} is not one of {len(loads)}"], None
    if reason not in ROUTE_REASONS:
        return [f"O2: route.decided reason {reason!r} unknown"], replica
    out: list[str] = []
    rule, tried = reason, []
    if reason == RETRY:
        rule = data.get("rule")
        got = _ints(data.get("resubmitted_from"))
        if rule not in (LEAST, AFFINITY):
            out.append(f"O2: retry_after_failure with rule {rule!r}")
        if not got or any(i >= len(loads) for i in got):
            out.append("O2: retry_after_failure without the replicas it left")
        tried = got or []
        if replica in tried:
            out.append(f"O2: retried onto replica {replica}, which had failed it")
    cands = [i for i in range(len(loads)) if i not in tried]
    if rule == LEAST and cands and loads[replica] > min(loads[i] for i in cands):
        out.append(f"O2: least_outstanding_tokens chose replica {replica} at "
                   f"{loads[replica]} tokens, another candidate had "
                   f"{min(loads[i] for i in cands)}")
    return out, replica


def check_routes(rows: Sequence[tr.TraceEvent]) -> list[str]:
    """The problems of one request's ``route.decided`` rows (``rows``: all its rows, in
    order)."""
    out: list[str] = []
    before: set[int] = set()
    engine_seen = False
    for n, ev in enumerate(rows):
        if ev.kind in tr.KNOWN_KINDS:
            engine_seen = True
            continue
        if ev.kind != tr.ROUTE_DECIDED:
            continue
        if engine_seen:
            out.append(f"O2: route.decided (row {n}) after the engine's rows began")
        problems, replica = _one(ev.data)
        out += problems
        if before:
            tried = set(_ints(ev.data.get("resubmitted_from")) or [])
            if ev.data.get("reason") != RETRY or not before <= tried:
                out.append(f"O2: a second decision (row {n}) that is not a retry away from "
                           f"replicas {sorted(before)}")
        if replica is not None:
            before.add(replica)
    return out
