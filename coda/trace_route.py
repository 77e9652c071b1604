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
a retry away from every replica tried before it, and no decision reads the clock after a later
decision or the engine's first row (the replica writes its decision before it submits; the
ingress's merged trace is sorted by time).

Per trace (:func:`check_routed_trace`): a trace is one replica's file (``--replicas``' per-process
``--trace``) or one request's merged trace, so when any request of it was routed, every request
was (a replica's trace opens each with the decision that brought it there), and the last
decision of each names one and the same replica (the one that ran them all).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from coda import trace as tr

__all__ = ["ROUTE_REASONS", "check_routed_trace", "check_routes"]

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
    if reason != RETRY and ("rule" in data or "resubmitted_from" in data):
        out.append(f"O2: a {reason} decision names the rule or replicas of a retry")
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
    decided_ns: int | None = None  # NOTE: the clock of the last decision
    for n, ev in enumerate(rows):
        if ev.kind in tr.KNOWN_KINDS:
            if not engine_seen and decided_ns is not None and ev.ts_ns < decided_ns:
                out.append(f"O2: the engine's first row (row {n}) reads the clock before the "
                           f"decision that brought the request ({ev.ts_ns} < {decided_ns})")
            engine_seen = True
            continue
        if ev.kind != tr.ROUTE_DECIDED:
            continue
        if engine_seen:
            out.append(f"O2: route.decided (row {n}) after the engine's rows began")
        if decided_ns is not None and ev.ts_ns < decided_ns:
            out.append(f"O2: route.decided (row {n}) reads the clock before the decision "
                       f"before it")
        decided_ns = max(ev.ts_ns, decided_ns or 0)
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


def _last_replica(rows: Sequence[tr.TraceEvent]) -> int | None:
    """The replica the request's last decision names (None: not routed, or unreadable)."""
    last = next((e for e in reversed(rows) if e.kind == tr.ROUTE_DECIDED), None)
    replica = last.data.get("replica") if last is not None else None
    return replica if isinstance(replica, int) and not isinstance(replica, bool) else None


def check_routed_trace(requests: Sequence[tuple[str, Sequence[tr.TraceEvent]]]) -> list[str]:
    """The problems of a whole trace's routing (``requests``: each request's name and rows,
    those with engine rows): one replica's requests, each opened by its decision."""
    routed = [(who, _last_replica(rows)) for who, rows in requests
              if any(e.kind == tr.ROUTE_DECIDED for e in rows)]
    if not routed:
        return []
    out = [f"{who}: O2: no route.decided, while {len(routed)} other request(s) of this trace "
           f"were routed (a replica's trace opens each request with its decision)"
           for who, rows in requests if not any(e.kind == tr.ROUTE_DECIDED for e in rows)]
    counts = Counter(r for _, r in routed if r is not None)
    if len(counts) > 1:
        # NOTE: the file's replica is the one most of its requests name
        mine = counts.most_common(1)[0][0]
        out += [f"{who}: O2: decided onto replica {r}, while {counts[mine]} request(s) of this "
                f"trace ran on replica {mine} (a trace file holds one replica's requests)"
                for who, r in routed if r is not None and r != mine]
    return out
