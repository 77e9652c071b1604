"""The trace checker: every rule a request's trace encodes, checked row by row
(SPEC L1–L7, T1, T2, G1, G2, S2, S3, K2, K3, P2, C1–C3, O1, O2).

``check_trace(events)`` returns one message per violation, each naming its rule; an empty list
means the engine (or the reference loop) could have written the trace (the rules are split
over :mod:`coda.trace_rules`, :mod:`coda.trace_steps`, :mod:`coda.trace_output`,
:mod:`coda.trace_preempt` and :mod:`coda.trace_terminal`). It is
the oracle of the trace corpus (``tests/test_trace_corpus.py``): every generated corruption
of a real trace that no run could have produced must be rejected. The rules, per request:

- L1/L2 lifecycle: transitions follow the graph; the terminal row directly follows the
  transition into its state and names that state; exactly one terminal; after it only the
  stream buffer's and then the trace handle's release (the last row; its ``rows`` count is the
  number of rows before it, so no row of the request was lost or added, O1).
- L7 resources: acquired once, in the ledger's order (stream buffer and trace handle first, the
  model's at admission), released once in order; the model's together directly before the
  terminal transition or ``cancel.effective``; ``rng_state``'s step is the selected count.
- T1/T2/G1 steps: ``token.selected`` t = 1, 2, ... only while DECODING and when every earlier
  token was decoded; ``decode.started``/``decode.completed`` of the last selected token, cache
  length = prompt + t; an ending decided by a token (eos, stop, length, grammar) drains in that
  token's step, with no decode after it (:mod:`coda.trace_steps`).
- S2/S3/K2 output: ``stop.state``, ``stream.delta`` and ``stop.hit`` only in a token's step or
  the drain; the string matcher's held bytes are exactly the unsent ones; nothing after a hit;
  a normal end sends everything (minus a dropped incomplete tail, K3).
- P2: delta sequence numbers 1, 2, ... without gaps, the terminal's next; bytes = text.
- C1–C3: one ``cancel.requested`` (any thread, any live moment before DRAINING), then the
  CANCEL_REQUESTED transition with ``cancel.observed``, then ``cancel.effective`` right before
  CANCELLED; no token after the observation.
- T4 preemption: ``kv.preempted`` (a running request's K/V dropped between steps; the cache it
  held) and ``kv.reacquired`` (blocks again; ``recompute`` + ``cached`` = prompt + selected)
  alternate, and no model step row falls between them (:mod:`coda.trace_preempt`); the
  ``kv_cache`` resource is still acquired and released once.
- L4–L6 terminal: reason allowed for the state, error code iff FAILED, usage equal to what the
  rows count (selected, processed, returned tokens and bytes, prompt and cache hits).
- O2 routing: ``route.decided`` rows (a replica router's) before the engine's and not after
  its first row's clock, each decision consistent with the loads it saw; in a trace with any
  routed request, every request routed, all onto one replica (:mod:`coda.trace_route`).
"""

from __future__ import annotations

from collections.abc import Iterable

from coda import trace as tr
from coda.trace_output import (
    close_step,
    on_delta,
    on_hit,
    on_reasoning_split,
    on_stop_state,
    on_tail_dropped,
)
from coda.trace_preempt import check_step_row, on_preempted, on_reacquired
from coda.trace_route import check_routed_trace, check_routes
from coda.trace_rules import (
    CANCEL_CAUSES,
    NEXT_STATES,
    REASON_NAMES,
    STATE_NAMES,
    Request,
    requests_of,
)
from coda.trace_steps import (
    on_decode_completed,
    on_decode_started,
    on_error,
    on_grammar_forced_close,
    on_prefill_completed,
    on_prefill_started,
    on_speculative_verify,
    on_token_selected,
)
from coda.trace_terminal import check_terminal

__all__ = ["check_trace"]

_MODEL = ("kv_cache", "batch_slot", "rng_state")
_ACQUIRE_ORDER = ("stream_buffer", "trace_handle", *_MODEL)
_RELEASE_ORDER = (*_MODEL, "stream_buffer", "trace_handle")


# NOTE: what a row's field of another type than the engine writes raises in the rules
_ILL_TYPED = (TypeError, ValueError, KeyError, AttributeError, IndexError)


def _ill_typed(exc: Exception) -> str:
    """O1: a row whose field has another type than the engine writes (a list for a resource's
    name, a string for a count): no run wrote it. It was the rule's own TypeError, a traceback
    out of ``coda trace check`` (exit 1, no verdict)."""
    return f"a row's field is not of the type the engine writes: {type(exc).__name__}: {exc} (O1)"


def check_trace(events: Iterable[tr.TraceEvent]) -> list[str]:
    """Every violation in a trace of one or many requests (empty: the trace is sound)."""
    problems: list[str] = []
    requests: list[tuple[str, list[tr.TraceEvent]]] = []
    # NOTE: an ended request's id may be used again (Python API): each lifetime on its own
    for rid, lives in requests_of(events).items():
        for n, evs in enumerate(lives, start=1):
            who = rid if n == 1 else f"{rid} (lifetime {n})"
            try:
                problems.extend(f"{who}: {p}" for p in check_routes(evs))
                if not any(e.kind in tr.KNOWN_KINDS for e in evs):
                    continue  # NOTE: not a request's rows (model.* rows; an ingress's decisions)
                requests.append((who, evs))
                problems.extend(f"{who}: {p}" for p in _Walk(evs).run())
            except _ILL_TYPED as exc:
                problems.append(f"{who}: {_ill_typed(exc)}")
    try:
        return problems + check_routed_trace(requests)
    except _ILL_TYPED as exc:
        return [*problems, _ill_typed(exc)]


class _Walk:
    """One pass over one request's rows; ``r`` accumulates what the terminal is checked
    against (:func:`coda.trace_rules.check_terminal`)."""

    def __init__(self, evs: list[tr.TraceEvent]) -> None:
        self.r = Request([e for e in evs if e.kind in tr.KNOWN_KINDS])

    def run(self) -> list[str]:
        r = self.r
        for i, ev in enumerate(r.rows):
            r.i, r.ev = i, ev
            if r.terminal_at is not None and ev.kind != tr.RESOURCE_RELEASED:
                r.bad("L3", "a row after the terminal event")
            if r.is_driver(i):
                self._driver_row(i, ev)
            check_step_row(r, ev)
            handler = getattr(self, "_" + ev.kind.replace(".", "_"))
            handler(ev)
        r.i = len(r.rows)
        close_step(r)
        if r.terminal_at is None:
            r.bad("L2", "no terminal event")
        r.check_resources()
        return r.out

    def _driver_row(self, i: int, ev: tr.TraceEvent) -> None:
        r = self.r
        if ev.ts_ns < r.last_ts:
            r.bad("O1", f"ts_ns {ev.ts_ns} before the previous row's {r.last_ts}")
        r.last_ts = ev.ts_ns
        r.step_was_open = r.step_open
        if ev.kind not in (tr.STREAM_DELTA, tr.STOP_HIT, tr.STOP_STATE, tr.REASONING_SPLIT):
            close_step(r, ev.kind)

    # -- lifecycle ---------------------------------------------------------------------------
    def _lifecycle(self, ev: tr.TraceEvent) -> None:
        r = self.r
        frm, to = ev.data.get("from"), ev.data.get("to")
        if frm not in STATE_NAMES or to not in STATE_NAMES:
            r.bad("L1", f"unknown state in {frm!r}->{to!r}")
            return
        if frm != r.state or to not in NEXT_STATES[frm]:
            r.bad("L1", f"illegal transition {frm}->{to} (state was {r.state})")
        prev = r.prev_kind()
        if to == "QUEUED" and prev != tr.RESOURCE_ACQUIRED:
            r.bad("L7", "QUEUED before the request's resources were acquired")
        # NOTE: the reference loop acquires the model's resources right after prefill.started
        if to == "DECODING" and r.model_run and \
                prev not in (tr.PREFILL_STARTED, tr.ERROR, tr.RESOURCE_ACQUIRED,
                             tr.KV_REACQUIRED):
            r.bad("T1", "DECODING without its prefill")
        if to == "CANCEL_REQUESTED":
            if r.cancel_requested is None:
                r.bad("C1", "cancel observed (CANCEL_REQUESTED) without a cancel.requested")
            if r.next_kind() != tr.CANCEL_OBSERVED:
                r.bad("C1", "CANCEL_REQUESTED not recorded with cancel.observed")
        if to == "CANCELLED" and prev != tr.CANCEL_EFFECTIVE:
            r.bad("C1", "CANCELLED not directly after cancel.effective")
        if to in ("FINISHED", "CANCELLED", "FAILED"):
            r.check_model_released(to)
            if r.next_kind() != tr.TERMINAL:
                r.bad("L2", f"{to} without its terminal event in the same critical section")
        if to == "DRAINING" and r.cancel_seen_at_safe_point:
            r.bad("G1", "a cancel pending at the safe point, yet the request drained (the "
                        "cancel check comes first)")
        if to == "DRAINING":
            r.drain_at = r.i
            r.drain_selected, r.drain_decoded = r.selected, r.decoded
            r.drain_after_token = r.step_was_open
        r.state = to

    # -- prefill, steps (coda.trace_steps) --------------------------------------------------
    def _prefill_started(self, ev: tr.TraceEvent) -> None:
        on_prefill_started(self.r, ev)

    def _prefill_completed(self, ev: tr.TraceEvent) -> None:
        on_prefill_completed(self.r, ev)

    def _grammar_forced_close(self, ev: tr.TraceEvent) -> None:
        on_grammar_forced_close(self.r, ev)

    def _token_selected(self, ev: tr.TraceEvent) -> None:
        on_token_selected(self.r, ev)

    def _decode_started(self, ev: tr.TraceEvent) -> None:
        on_decode_started(self.r, ev)

    def _decode_completed(self, ev: tr.TraceEvent) -> None:
        on_decode_completed(self.r, ev)

    def _speculative_verify(self, ev: tr.TraceEvent) -> None:
        on_speculative_verify(self.r, ev)

    def _error(self, ev: tr.TraceEvent) -> None:
        on_error(self.r, ev)

    # -- output ------------------------------------------------------------------------------
    def _stop_state(self, ev: tr.TraceEvent) -> None:
        on_stop_state(self.r, ev)

    def _stream_delta(self, ev: tr.TraceEvent) -> None:
        on_delta(self.r, ev)

    def _stop_hit(self, ev: tr.TraceEvent) -> None:
        on_hit(self.r, ev)

    def _reasoning_split(self, ev: tr.TraceEvent) -> None:
        on_reasoning_split(self.r, ev)

    def _utf8_tail_dropped(self, ev: tr.TraceEvent) -> None:
        on_tail_dropped(self.r, ev)

    # -- cancellation ------------------------------------------------------------------------
    def _cancel_requested(self, ev: tr.TraceEvent) -> None:
        r = self.r
        if r.cancel_requested is not None:
            r.bad("C1", "a second cancel.requested")
        r.cancel_requested = ev
        cause = ev.data.get("cause")
        if cause not in CANCEL_CAUSES:
            r.bad("C1", f"unknown cancel cause {cause!r}")
        if r.acquired_order[:2] != ["stream_buffer", "trace_handle"]:
            r.bad("C1", "cancel requested before the request existed")
        if r.state in ("DRAINING", "FINISHED", "CANCELLED", "FAILED"):
            r.bad("C1", f"cancel requested while {r.state} (a late cancel records nothing)")
        if cause == "early_stop":
            if ev.data.get("reason") not in REASON_NAMES or r.state != "DECODING":
                r.bad("D6", "early-stop cancel without its reason or outside a step")
            if r.next_transition_to() != "CANCEL_REQUESTED":
                r.bad("D6", "an early stop not taking the cancel path at once")
        elif cause == "shutdown" and r.next_transition_to() != "CANCEL_REQUESTED":
            r.bad("C1", "a shutdown's cancel not observed at once (abort_all)")
        elif cause == "backpressure" and r.sent == 0:
            r.bad("P6", "a backpressure cancel before any byte was sent")
        elif "reason" in ev.data:
            r.bad("C1", "only an early stop's cancel names a reason")

    def _cancel_observed(self, ev: tr.TraceEvent) -> None:
        r = self.r
        if r.cancel_observed:
            r.bad("C1", "a second cancel.observed")
        if r.cancel_requested is None:
            r.bad("C1", "cancel.observed without an earlier cancel.requested")
        if r.prev_transition_to() != "CANCEL_REQUESTED":
            r.bad("C1", "cancel.observed not at the CANCEL_REQUESTED transition")
        r.cancel_observed = True

    def _cancel_effective(self, ev: tr.TraceEvent) -> None:
        r = self.r
        if r.cancel_effective:
            r.bad("C1", "a second cancel.effective")
        if not r.cancel_observed or r.state != "CANCEL_REQUESTED":
            r.bad("C1", "cancel.effective before the cancel was observed")
        r.check_model_released("cancel.effective")
        if r.next_transition_to() != "CANCELLED":
            r.bad("C1", "cancel.effective not directly before CANCELLED")
        r.cancel_effective = True

    # -- preemption (coda.trace_preempt) -----------------------------------------------------
    def _kv_preempted(self, ev: tr.TraceEvent) -> None:
        on_preempted(self.r, ev)

    def _kv_reacquired(self, ev: tr.TraceEvent) -> None:
        on_reacquired(self.r, ev)

    # -- resources, terminal -----------------------------------------------------------------
    def _resource_acquired(self, ev: tr.TraceEvent) -> None:
        self.r.on_acquired(ev, _ACQUIRE_ORDER)

    def _resource_released(self, ev: tr.TraceEvent) -> None:
        self.r.on_released(ev, _RELEASE_ORDER)

    def _terminal(self, ev: tr.TraceEvent) -> None:
        r = self.r
        if r.terminal_at is not None:
            r.bad("L2", "more than one terminal event")
            return
        r.terminal_at = r.i
        if ev.data.get("state") != r.state or r.prev_kind() != tr.LIFECYCLE:
            r.bad("L2", f"terminal state {ev.data.get('state')!r} is not the lifecycle's "
                        f"{r.state}")
        check_terminal(r, ev)
