"""The corpus's allow-list (issue 20 deliverable 3; the corpus: :mod:`tests.trace_corpus`):
the corruptions the engine could have written, each entry with its reason. The checker must
ACCEPT every corruption an entry matches (so the list cannot hide a checker that rejects what
the engine writes) and reject every other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from coda import trace as tr
from coda.finish import REASONS_BY_VERSION
from coda.trace import TraceEvent
from coda.trace_route import AFFINITY, LEAST, RETRY
from coda.trace_rules import FINISHED_REASONS, TOKEN_REASONS
from tests.trace_mutations import Mutation


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

