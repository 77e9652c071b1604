"""The trace checker's corruption corpus (issue 20 deliverable 3): mutation testing of
:func:`coda.trace.check_trace` on real traces.

From a real trace (``tests/data/faultmix_trace.jsonl``, written by
``scripts/trace_faultmix.py``), every corruption class is generated on one request's rows:
drop a row, duplicate a row, swap two adjacent rows (their payloads; the timestamps stay in
place, so the clock alone cannot give a swap away), tamper a field (an int ±1, a bool flipped,
an enum to another member, a string extended, a timestamp moved before the previous row's).
A class is (operation, row kind) or (swap, kind, kind) or (tamper, kind, field); each is
sampled at up to ``per_class`` sites, spread over the requests.

Each corruption must be rejected unless the engine could have written it; those are matched
by an entry of :data:`ALLOWED` (with its reason), and the checker must ACCEPT them (so the
allow-list cannot hide a checker that rejects what the engine writes).
"""

from __future__ import annotations

import random
import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from coda import trace as tr
from coda.finish import REASONS_BY_VERSION
from coda.trace import TraceEvent, check_trace, read_jsonl
from coda.trace_route import AFFINITY, LEAST, RETRY, ROUTE_REASONS
from coda.trace_rules import CANCEL_CAUSES, FINISHED_REASONS, TOKEN_REASONS

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


# ------------------------------------------------------------------------------ allow-list
@dataclass(frozen=True)
class Allowed:
    name: str
    reason: str
    match: Callable[[Mutation, list[TraceEvent]], bool]


def _client_cancel(ev: TraceEvent) -> bool:
    """A cancel.requested another thread writes (see Request.is_driver)."""
    return ev.kind == tr.CANCEL_REQUESTED and ev.data.get("cause") not in ("early_stop",
                                                                           "shutdown")


def _cancel_moved_within_its_window(m: Mutation, rows: list[TraceEvent]) -> bool:
    """A client's cancel.requested swapped with a neighbour and still inside the window where
    another thread may record it: after the request exists, before the CANCEL_REQUESTED or
    DRAINING transition or the terminal, and not before a safe point (a decode.completed or
    prefill.completed followed by a token or a deadline's drain) that would have seen it."""
    if m.op != "swap" or not (_client_cancel(rows[m.i]) or _client_cancel(rows[m.i + 1])):
        return False
    moved = m.apply(rows)
    at = next(k for k, e in enumerate(moved) if _client_cancel(e))
    # NOTE: the request exists once its stream buffer and trace handle are acquired, its first
    # two engine rows: a replica's route.decided before them does not count
    if sum(e.kind in tr.KNOWN_KINDS for e in moved[:at]) < 2:
        return False
    for e in moved[at + 1:]:
        if e.kind in (tr.CANCEL_OBSERVED, tr.TERMINAL) or (
                e.kind == tr.LIFECYCLE and e.data.get("to") == "CANCEL_REQUESTED"):
            break
    else:
        return False
    for e in moved[:at]:
        if e.kind == tr.LIFECYCLE and e.data.get("to") in ("DRAINING", "CANCEL_REQUESTED"):
            return False
    safe_point = False
    for e in moved[at + 1:]:
        if e.kind == tr.CANCEL_OBSERVED or (e.kind == tr.LIFECYCLE
                                            and e.data.get("to") == "CANCEL_REQUESTED"):
            break
        if e.kind in (tr.DECODE_COMPLETED, tr.PREFILL_COMPLETED):
            safe_point = True
        elif safe_point and (e.kind == tr.TOKEN_SELECTED or (
                e.kind == tr.LIFECYCLE and e.data.get("to") == "DRAINING")):
            return False
    return True


def _tamper(kind: str, *paths: str) -> Callable[[Mutation, list[TraceEvent]], bool]:
    def match(m: Mutation, rows: list[TraceEvent]) -> bool:
        return m.op == "tamper" and rows[m.i].kind == kind and m.path in paths
    return match


def _stop_not_shown(m: Mutation, rows: list[TraceEvent]) -> bool:
    """Another stop string that was never shown and still ends inside the hit's push."""
    if not _tamper(tr.STOP_HIT, "stop")(m, rows) or rows[m.i].data.get("which") != "string":
        return False
    term = next(e for e in rows if e.kind == tr.TERMINAL)
    offset = rows[m.i].data.get("byte_offset")
    if term.data["usage"]["returned_bytes"] != offset:
        return False
    states = [e for e in rows[:m.i] if e.kind == tr.STOP_STATE and not e.data.get("stops_off")]
    pushed = sum(e.data["nbytes"] for e in states)
    end = offset + len(str(m.value).encode("utf-8"))
    return bool(pushed - states[-1].data["nbytes"] < end <= pushed)


def _unacked_within_sent(m: Mutation, rows: list[TraceEvent]) -> bool:
    if not _tamper(tr.RESOURCE_RELEASED, "unacked_bytes")(m, rows):
        return False
    sent = sum(e.data["nbytes"] for e in rows if e.kind == tr.STREAM_DELTA)
    return isinstance(m.value, int) and 0 <= m.value <= sent


def _finish_reason_swap(m: Mutation, rows: list[TraceEvent]) -> bool:
    """FINISHED reason A -> B where both are endings the trace cannot tell apart: the budget
    (max tokens, context), the grammar and the deadline are not recorded; a token ending needs
    the drain in the last token's step, and eos needs that step to have shown nothing."""
    if not (m.op == "tamper" and rows[m.i].kind == tr.TERMINAL and m.path == "reason"):
        return False
    ev = rows[m.i]
    loose = FINISHED_REASONS - {"stop_sequence"}
    if m.old not in loose or m.value not in loose:
        return False
    # NOTE: a K3 failure at the drain keeps the reason the loop stopped for
    if ev.data.get("state") != "FINISHED" and not (
            ev.data.get("state") == "FAILED" and ev.data.get("error") == "decoding_error"
            and m.value != "deadline_exceeded"):
        return False
    drain = next(k for k, e in enumerate(rows) if e.kind == tr.LIFECYCLE
                 and e.data.get("to") == "DRAINING")
    last_tok = max((k for k, e in enumerate(rows[:drain]) if e.kind == tr.TOKEN_SELECTED),
                   default=None)
    if last_tok is None:
        return False
    between = [e.kind for e in rows[last_tok + 1:drain] if not _client_cancel(e)]
    in_step = all(k in (tr.STOP_STATE, tr.STREAM_DELTA) for k in between)
    if m.value in TOKEN_REASONS and not in_step:
        return False
    return not (m.value == "eos" and between)


def _hit_token_tail(m: Mutation, rows: list[TraceEvent]) -> bool:
    """Another byte count for the token whose push completed a string stop: bytes after the
    stop are discarded unseen, and how many a token has is the tokenizer's."""
    if not _tamper(tr.STOP_STATE, "nbytes")(m, rows) or not isinstance(m.value, int):
        return False
    hit = None
    for e in rows[m.i + 1:]:
        if e.kind == tr.STOP_HIT:
            hit = e
            break
        if e.kind != tr.STREAM_DELTA:
            return False
    if hit is None or hit.data.get("which") != "string":
        return False
    if m.value > m.old:
        return True
    # NOTE: fewer bytes are another token only while its push still reaches the stop's end:
    # the bytes it loses must be tail bytes after the stop, never the stop's own (a token of
    # at least one byte; a push ending before the stop's end would not have hit it)
    pushed = sum(e.data["nbytes"] - max(e.data.get("discarded") or 0, 0)
                 for e in rows[:m.i + 1]
                 if e.kind == tr.STOP_STATE and not e.data.get("stops_off"))
    end = hit.data["byte_offset"] + len(str(hit.data["stop"]).encode("utf-8"))
    return bool(m.value >= 1 and end <= pushed - (m.old - m.value))


def _clock_vs_client_cancel(m: Mutation, rows: list[TraceEvent]) -> bool:
    """A driver row's clock moved before a client cancel's row but not before the driver's
    previous row: the two threads' readings race (see cancel-clock)."""
    if not (m.op == "tamper" and m.path == "ts_ns") or m.i == 0:
        return False
    if not _client_cancel(rows[m.i - 1]):
        return False
    prev = next((e for e in reversed(rows[:m.i - 1]) if not _client_cancel(e)), None)
    return prev is None or m.value >= prev.ts_ns


def _prompt_unseen(m: Mutation, rows: list[TraceEvent]) -> bool:
    """usage.prompt_tokens of a request that ended before its prefill: no other row counts it."""
    return _tamper(tr.TERMINAL, "usage.prompt_tokens")(m, rows) and isinstance(m.value, int) \
        and m.value > 0 and not any(e.kind == tr.PREFILL_STARTED for e in rows)


def _cause_of_same_ending(m: Mutation, rows: list[TraceEvent]) -> bool:
    """A cancel's cause swapped for another that ends the same way, written in the same place
    (the Python API's ``handle.cancel(cause)`` names any): a shutdown's for a client's (both
    ``cancelled``; a client's may land right before the observation), a backpressure cancel's
    for a disconnect's, and a disconnect's for a backpressure one's once bytes were sent (both
    ``transport_error``, both from another thread; P6 wants a byte sent first)."""
    if not _tamper(tr.CANCEL_REQUESTED, "cause")(m, rows):
        return False
    if (m.old, m.value) in (("shutdown", "client"), ("backpressure", "disconnect")):
        return True
    sent = sum(e.data["nbytes"] for e in rows[:m.i] if e.kind == tr.STREAM_DELTA)
    return (m.old, m.value) == ("disconnect", "backpressure") and sent > 0


def _block_count(m: Mutation, rows: list[TraceEvent]) -> bool:
    """Another count of blocks dropped by a preemption, still at least one (T4)."""
    return _tamper(tr.KV_PREEMPTED, "blocks")(m, rows) and isinstance(m.value, int) \
        and m.value >= 1


def _older_enum(m: Mutation, rows: list[TraceEvent]) -> bool:
    if not _tamper(tr.TERMINAL, "finish_reason_version")(m, rows):
        return False
    return rows[m.i].data.get("reason") in REASONS_BY_VERSION.get(m.value, ())


def _route_rule(m: Mutation, rows: list[TraceEvent]) -> bool:
    """A decision's rule swapped between least outstanding and prefix affinity where both
    could have chosen its replica: affinity may pick any candidate within the router's slack,
    least outstanding only a least loaded one (O2 checks that)."""
    if not _tamper(tr.ROUTE_DECIDED, "reason", "rule")(m, rows) \
            or {m.old, m.value} != {LEAST, AFFINITY}:
        return False
    data = rows[m.i].data
    if m.path == "reason" and data.get("reason") == RETRY:
        return False
    loads, tried = data["outstanding"], set(data.get("resubmitted_from") or [])
    least = min(v for k, v in enumerate(loads) if k not in tried)
    return bool(m.value == AFFINITY or loads[data["replica"]] == least)


def _fewer_replicas(m: Mutation, rows: list[TraceEvent]) -> bool:
    """A decision's loads for fewer replicas, still holding its replica and those it left."""
    if not _tamper(tr.ROUTE_DECIDED, "outstanding")(m, rows) or not m.value:
        return False
    data = rows[m.i].data
    named = [data["replica"], *(data.get("resubmitted_from") or [])]
    return bool(max(named) < len(m.value))


ALLOWED: tuple[Allowed, ...] = (
    Allowed("cancel-moves", "a client's cancel.requested is written by another thread at any "
            "moment of its window (C1 moment 1); moving it inside that window is a trace the "
            "engine writes under another timing", _cancel_moved_within_its_window),
    Allowed("cancel-clock", "a client's cancel.requested takes its timestamp on another thread, "
            "before it gets the sink's lock: its clock may read earlier than the row before it",
            lambda m, rows: _tamper(tr.CANCEL_REQUESTED, "ts_ns")(m, rows)
            and _client_cancel(rows[m.i])),
    Allowed("clock-vs-cancel", "a row's clock reading earlier than a client cancel's row "
            "before it (but not than the driver's own previous row): another thread's clock",
            _clock_vs_client_cancel),
    Allowed("hit-token-tail", "the token that completes a stop string may carry more or "
            "fewer bytes after the stop's end; they are discarded unseen and their count is "
            "the tokenizer's", _hit_token_tail),
    Allowed("model-decision", "logprob, prob, top_logprobs and greedy are the model's and the "
            "sampler's numbers; another checkpoint or seed writes other values (the checker has "
            "no model)", _tamper(tr.TOKEN_SELECTED, "decision.logprob", "decision.prob",
                                  "decision.top_logprobs", "decision.greedy")),
    Allowed("tokenizer-state", "detok_pending (bytes of an unfinished character) depends on the "
            "tokenizer, which the trace does not record", _tamper(tr.STOP_STATE, "detok_pending")),
    Allowed("stop-config", "ids_held, a hit's index and a stop string that never reached the "
            "stream depend on the request's stop list, which the trace does not record",
            lambda m, rows: _tamper(tr.STOP_STATE, "ids_held")(m, rows)
            or _tamper(tr.STOP_HIT, "index")(m, rows) or _stop_not_shown(m, rows)),
    Allowed("grammar-path", "the closing path's rejected token, length and text come from the "
            "grammar, which the trace does not record",
            _tamper(tr.GRAMMAR_FORCED, "rejected", "path_tokens", "path_text")),
    Allowed("error-text", "a model error row's text is the exception the device raised; "
            "another fault writes another", _tamper(tr.ERROR, "error")),
    Allowed("release-detail", "a release's ok flag (a failed clean-up is logged, L7), the "
            "number of listeners and unacknowledged bytes up to what was sent depend on the "
            "readers and the clean-up, not on the request",
            lambda m, rows: _tamper(tr.RESOURCE_RELEASED, "ok", "listeners")(m, rows)
            or _unacked_within_sent(m, rows)),
    Allowed("finish-budget", "max tokens, the context limit, the grammar, the EOS ids and the "
            "deadline are not in the trace: a FINISHED end among them (or a K3 failure's kept "
            "reason) that the rows allow could be another",
            _finish_reason_swap),
    Allowed("prompt-unseen", "a request that ended before its prefill (cancelled or past its "
            "deadline while queued) shows its prompt length only in usage; another prompt "
            "writes another", _prompt_unseen),
    Allowed("cancel-cause", "a cancel's cause is recorded in its cancel.requested row only, "
            "and causes with the same ending written in the same place are a trace the engine "
            "writes for another caller (a shutdown's and a client's; a disconnect's and a "
            "backpressure cancel's once bytes were sent)", _cause_of_same_ending),
    Allowed("kv-blocks", "the blocks a preemption drops hold its cache_len tokens in blocks "
            "of the engine's block size (and a prefill's whole prompt), which the trace does "
            "not record: another block size writes another count", _block_count),
    Allowed("route-rule", "whether a prompt's first block went to a replica before (prefix "
            "affinity) and the router's affinity slack are the ingress's state, not the "
            "trace's: a decision that least outstanding tokens could also have made may name "
            "either rule", _route_rule),
    Allowed("replica-count", "outstanding holds one load per replica of the ingress that "
            "decided; an ingress that joins the cluster with fewer --replicas routes over the "
            "first N replica applications and writes a shorter list into the same replica's "
            "trace, so how many a decision names is not one file's", _fewer_replicas),
    Allowed("older-enum", "an earlier finish-reason enum version that has the reason: a trace "
            "an earlier release wrote, which the checker accepts by design (L4 versioning)",
            _older_enum),
)


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
