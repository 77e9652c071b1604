"""The state the trace checker keeps per request, its neighbour lookups and the resource
rules (SPEC L7, O1), the versions check of terminal and stop.hit rows (L4, S4), and the split
of one id's rows into the lifetimes of the requests that used it in turn. Used by
:mod:`coda.trace_check`, which walks the rows and documents the rules as a whole; the output
rules are :mod:`coda.trace_output`, the terminal's :mod:`coda.trace_terminal`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from coda import trace as tr
from coda.early_stop_failure import StreamFailureReason
from coda.errors import ErrorCode
from coda.finish import REASONS_BY_VERSION, CancelCause, FinishReason
from coda.lifecycle import TRANSITIONS, State
from coda.stops import STOP_RULE_VERSION

STATE_NAMES = frozenset(s.value for s in State)
NEXT_STATES = {s.value: frozenset(t.value for t in nxt) for s, nxt in TRANSITIONS.items()}
CANCEL_CAUSES = frozenset(c.value for c in CancelCause)
REASON_NAMES = frozenset(r.value for r in FinishReason)
ERROR_CODES = frozenset(c.value for c in ErrorCode)
FAILURE_DECISIONS = frozenset(d.value for d in StreamFailureReason)
KNOWN_STOP_RULE_VERSIONS = frozenset({STOP_RULE_VERSION})
_MODEL = frozenset({"kv_cache", "batch_slot", "rng_state"})
_DRIVER_CAUSES = frozenset({"early_stop", "shutdown"})
# endings decided right after a token (G1): the drain happens in that token's step (T2)
TOKEN_REASONS = frozenset({"eos", "stop_sequence", "max_output_tokens", "context_limit",
                           "grammar_complete", "grammar_forced_close"})
FINISHED_REASONS = TOKEN_REASONS | {"deadline_exceeded"}
_STREAM = ("stream_buffer", "trace_handle")  # held from birth, released after the terminal
_ENDED = frozenset({"FINISHED", "CANCELLED", "FAILED"})
_OPENS = (tr.RESOURCE_ACQUIRED, "stream_buffer")  # a request's first row
# a request's last rows: its terminal and its stream's releases (RequestRun._end)
_LAST_ROWS = frozenset({(tr.TERMINAL, None), *((tr.RESOURCE_RELEASED, k) for k in _STREAM)})
# the rows a request's caller's thread may write before its driver takes it: its birth rows
# (Lifecycle's first row), a client's cancel.requested (RequestRun.request_cancel)
_CALLER_ROWS = frozenset({*((tr.RESOURCE_ACQUIRED, k) for k in _STREAM),
                          (tr.CANCEL_REQUESTED, None)})


def _key(ev: tr.TraceEvent) -> tuple[str, Any]:
    # NOTE: a field of another type (a damaged trace) splits nothing; the walk names it (O1)
    return ev.kind, _name(ev.data.get("resource"))


def requests_of(events: Iterable[tr.TraceEvent]) -> dict[str, list[list[tr.TraceEvent]]]:
    """A trace's rows per request id, each id's split into its lifetimes (:func:`lifetimes`)."""
    by_id: dict[str, list[tr.TraceEvent]] = {}
    for ev in events:
        by_id.setdefault(ev.request_id, []).append(ev)
    return {rid: lifetimes(rows) for rid, rows in by_id.items()}


def lifetimes(rows: Sequence[tr.TraceEvent]) -> list[list[tr.TraceEvent]]:
    """One id's rows (in order) split into the requests that used it one after another (the
    Python API lets an ended request's id be used again, DuplicateRequestIdError): a new
    lifetime starts at the row that opens a request (its ``stream_buffer`` acquisition) once
    the current one has ended (its transition into FINISHED, CANCELLED or FAILED; only the
    Python API lets a caller choose an id: the server's own rows, ``route.decided``,
    ``input.truncated``, ``model.*``, name ids it made up, never reused). Any mix of two
    requests stays in one lifetime, where the walk rejects it (acquired twice, a row after
    the terminal: L3, L7).

    The engine writes a request's last rows (its terminal, its stream buffer's and trace
    handle's releases) before its end is visible to anyone (``RequestRun._end``), so its
    lifetimes follow each other whole. Traces written before (up to 2026-12-05, still on
    disk) have those rows after the stream's close, which let the caller use the id again
    at once: the next request's rows its caller's thread writes (``_CALLER_ROWS``) may come
    before them, so the ones the ended request still owes go back to it until a row of the
    next one's driver shows it wrote all it would."""
    out: list[list[tr.TraceEvent]] = [[]]
    owed: set[tuple[str, Any]] = set()  # NOTE: an old trace's ended request's last rows
    done = False  # the current lifetime has ended
    for ev in rows:
        key = _key(ev)
        if key in owed:
            owed.discard(key)
            out[-2].append(ev)
            continue
        if key not in _CALLER_ROWS:
            owed = set()
        if done and key == _OPENS:
            owed = set(_LAST_ROWS - {_key(e) for e in out[-1]})
            out.append([])
            done = False
        out[-1].append(ev)
        done = done or ev.kind == tr.TERMINAL or (
            ev.kind == tr.LIFECYCLE and _name(ev.data.get("to")) in _ENDED)
    return out


def _name(value: Any) -> str | None:
    """A row's name field (a resource, a state) as :func:`lifetimes` compares it: None unless
    a string (it raised TypeError on a list, out of ``coda trace check``)."""
    return value if isinstance(value, str) else None


@dataclass
class Request:
    """One request's rows and what the walk has seen so far."""

    rows: list[tr.TraceEvent]
    out: list[str] = field(default_factory=list)
    i: int = 0
    ev: tr.TraceEvent | None = None
    state: str = "CREATED"
    last_ts: int = 0
    selected: int = 0
    decoded: int = 0
    last_token_at: int | None = None
    step_open: bool = False        # a token's step: its stop.state/delta/hit may follow
    step_was_open: bool = False    # step_open before the current row
    decode_open: tr.TraceEvent | None = None
    prefill: tr.TraceEvent | None = None
    prefill_done: tr.TraceEvent | None = None
    drain_at: int | None = None
    drain_selected: int = 0
    drain_decoded: int = 0
    drain_after_token: bool = False
    cancel_requested: tr.TraceEvent | None = None
    cancel_observed: bool = False
    cancel_effective: bool = False
    cancel_seen_at_safe_point: bool = False  # requested before a safe point that then passed
    terminal_at: int | None = None
    hit: tr.TraceEvent | None = None
    tail: tr.TraceEvent | None = None
    pushed: int = 0                # bytes the detokenizer produced (stop.state nbytes)
    sent: int = 0                  # bytes on the stream (delta nbytes)
    removed: int = 0               # reasoning marker bytes removed (issue 23, reasoning.split)
    reasoning_sent: int = 0        # ... and reasoning bytes sent (deltas marked reasoning)
    seq: int = 0
    text: list[str] = field(default_factory=list)
    token_starts: list[int] = field(default_factory=list)  # stream offset of visible tokens
    held_check: tuple[int, int] | None = None  # (held, pushed) to compare at the step's end
    last_state: tr.TraceEvent | None = None    # the current step's (or drain's) stop.state
    last_held: int = 0             # bytes the previous push left held (stop or tag wait)
    held_before: int = 0           # ... as this push found them: a hit may end in them
    preempted: bool = False        # K/V dropped (kv.preempted), not yet reacquired (T4)
    preemptions: int = 0
    acquired_order: list[str] = field(default_factory=list)
    released_order: list[str] = field(default_factory=list)

    # False for a run that never held the model (a lifecycle test's hand-driven run, or the
    # reference loop cancelled before its prefill): the step rules do not apply
    model_run: bool = field(init=False)
    # stop.state rows record their byte count (traces written since issue 20); a model run
    # with no stop.state row pushed no byte in either format, so its count (0) is known too
    # (a hand-driven run has no output processor to write them)
    pushed_known: bool = field(init=False)

    def __post_init__(self) -> None:
        # NOTE: computed once: per-row scans would make the walk quadratic on long requests
        self.model_run = any(e.kind == tr.RESOURCE_ACQUIRED and e.data.get("resource") in _MODEL
                             for e in self.rows)
        states = [e for e in self.rows if e.kind == tr.STOP_STATE]
        self.pushed_known = (self.model_run and not states) or any(
            "nbytes" in e.data for e in states)

    def reach_safe_point(self) -> None:
        """A prefill.completed or decode.completed row: the driver checks for a cancel next
        (before choose, G1); one recorded before this row is visible to that check."""
        if self.cancel_requested is not None and not self.cancel_observed:
            self.cancel_seen_at_safe_point = True

    def bad(self, rule: str, message: str) -> None:
        kind = self.ev.kind if self.ev is not None and self.i < len(self.rows) else "end"
        self.out.append(f"row {self.i} {kind}: {message} ({rule})")

    # -- neighbours (rows a client's cancel.requested may land between are skipped) ----------
    def is_driver(self, i: int) -> bool:
        """False for a cancel.requested from another thread (a client, a disconnect, a slow
        reader), written at any live moment; an early stop's and a shutdown's are the
        driver's own (D6, ``abort_all``), observed at once. A ``speculative.verify`` row is
        the step's own summary and is skipped by the neighbour checks too."""
        ev = self.rows[i]
        if ev.kind == tr.SPECULATIVE:
            return False  # NOTE: issue 21: a verification's summary sits inside its step
        return not (ev.kind == tr.CANCEL_REQUESTED and ev.data.get("cause") not in _DRIVER_CAUSES)

    def prev_row(self) -> tr.TraceEvent | None:
        j = self.i - 1
        while j >= 0 and not self.is_driver(j):
            j -= 1
        return self.rows[j] if j >= 0 else None

    def next_row(self) -> tr.TraceEvent | None:
        j = self.i + 1
        while j < len(self.rows) and not self.is_driver(j):
            j += 1
        return self.rows[j] if j < len(self.rows) else None

    def prev_kind(self) -> str | None:
        row = self.prev_row()
        return row.kind if row is not None else None

    def next_kind(self) -> str | None:
        row = self.next_row()
        return row.kind if row is not None else None

    def prev_transition_to(self) -> Any:
        row = self.prev_row()
        return row.data.get("to") if row is not None and row.kind == tr.LIFECYCLE else None

    def next_transition_to(self) -> Any:
        row = self.next_row()
        return row.data.get("to") if row is not None and row.kind == tr.LIFECYCLE else None

    # -- resources (L7) ----------------------------------------------------------------------
    def on_acquired(self, ev: tr.TraceEvent, order: tuple[str, ...]) -> None:
        kind = str(ev.data.get("resource"))
        if kind in self.acquired_order:
            self.bad("L7", f"resource {kind}: acquired twice")
        elif kind in order and any(order.index(k) > order.index(kind)
                                   for k in self.acquired_order if k in order):
            self.bad("L7", f"resource {kind} acquired out of the ledger's order")
        if kind in ("stream_buffer", "trace_handle") and self.i != order.index(kind):
            self.bad("L7", f"{kind} not acquired when the request was created")
        if kind in _MODEL and not (self.state == "CREATED" or (
                self.state == "PREFILLING" and self.prefill is not None
                and self.prefill_done is None)):
            self.bad("L7", f"{kind} acquired while {self.state}, not at admission")
        # NOTE: admission acquires the model's resources in one go (core, reference loop)
        before = order[order.index(kind) - 1] if kind in _MODEL and kind in order else None
        prev = self.prev_row()
        if before in _MODEL and not (prev is not None and prev.kind == tr.RESOURCE_ACQUIRED
                                     and prev.data.get("resource") == before):
            self.bad("L7", f"{kind} not acquired right after {before} (admission takes the "
                           f"model's resources together)")
        self.acquired_order.append(kind)

    def on_released(self, ev: tr.TraceEvent, order: tuple[str, ...]) -> None:
        kind = str(ev.data.get("resource"))
        if kind in self.released_order:
            self.bad("L7", f"resource {kind}: released 2x")
        elif kind not in self.acquired_order:
            self.bad("L7", f"resource {kind} released before it was acquired")
        elif kind in order and any(order.index(k) > order.index(kind)
                                   for k in self.released_order if k in order):
            self.bad("L7", f"resource {kind} released out of the ledger's order")
        self.released_order.append(kind)
        if not isinstance(ev.data.get("ok"), bool):
            self.bad("L7", "release row without a boolean ok")
        nxt = self.next_row()
        if kind in _MODEL:
            if not (nxt is not None and (nxt.kind == tr.CANCEL_EFFECTIVE or (
                    nxt.kind == tr.RESOURCE_RELEASED and nxt.data.get("resource") in _MODEL)
                    or (nxt.kind == tr.LIFECYCLE and nxt.data.get("to") in
                        ("FINISHED", "FAILED")))):
                self.bad("L7", f"{kind} not released at the ending's safe point")
            if ev.data.get("held", 0) != 0:  # NOTE: the reference loop's rows: nothing held
                self.bad("L7", f"{kind} released with held={ev.data['held']!r}; the reference "
                               f"loop holds no batch row or RNG cursor")
            if "step" in ev.data and ev.data["step"] != self.selected:
                self.bad("L7", f"rng_state released at step {ev.data['step']} after "
                               f"{self.selected} selections")
        elif kind == "stream_buffer":
            unacked = ev.data.get("unacked_bytes", 0)
            if self.prev_kind() != tr.TERMINAL:
                self.bad("L7", "stream buffer not released right after the terminal")
            if not isinstance(unacked, int) or not 0 <= unacked <= self.sent:
                self.bad("P6", f"{unacked!r} unacknowledged bytes of {self.sent} sent")
        elif kind == "trace_handle":
            if self.i != len(self.rows) - 1 or self.prev_kind() != tr.RESOURCE_RELEASED:
                self.bad("L7", "the trace handle's release is not the request's last row")
            if "rows" in ev.data and ev.data["rows"] != self.i:
                self.bad("O1", f"the trace handle wrote {ev.data['rows']} rows, "
                               f"{self.i} are here")

    def check_model_released(self, at: str) -> None:
        held = [k for k in self.acquired_order if k in _MODEL and k not in self.released_order]
        if held:
            self.bad("L7", f"{', '.join(held)} still held at {at}")

    def check_resources(self) -> None:
        self.ev = None
        for kind in set(self.acquired_order) | set(self.released_order):
            a, r = self.acquired_order.count(kind), self.released_order.count(kind)
            if a != 1 or r != 1:
                self.bad("L7", f"resource {kind}: acquired {a}x, released {r}x")


def check_verify_row(r: Request, ev: tr.TraceEvent) -> None:
    """Issue 21 (O1): a ``speculative.verify`` row, which the neighbour checks skip (it sits
    inside its token's step), is still the driver's: written at that token's choose, right
    after the forward that verified (its decode.completed, or the prefill's), and read on the
    driver's clock like every row it writes."""
    if ev.ts_ns < r.last_ts:
        r.bad("O1", f"ts_ns {ev.ts_ns} before the previous row's {r.last_ts}")
    r.last_ts = ev.ts_ns
    if r.prev_kind() not in (tr.PREFILL_COMPLETED, tr.DECODE_COMPLETED):
        r.bad("O1", f"speculative.verify after {r.prev_kind()}, not at its token's choose")


def check_versions(ev: tr.TraceEvent) -> list[str]:
    """L4/S4: the terminal row says which enum and tie rule decided it, and its reason is a
    member of that enum version."""
    out: list[str] = []
    rule = ev.data.get("stop_rule_version")
    if rule not in KNOWN_STOP_RULE_VERSIONS:
        out.append(f"{ev.kind}: unknown or missing stop_rule_version {rule!r} (S4)")
    version = ev.data.get("finish_reason_version")
    members = REASONS_BY_VERSION.get(version) if isinstance(version, int) else None
    if members is None:
        out.append(f"terminal: unknown or missing finish_reason_version {version!r} (L4)")
    elif ev.data.get("reason") not in members:
        out.append(f"terminal: reason {ev.data.get('reason')!r} is not in finish-reason "
                   f"enum version {version} (L4)")
    return out

