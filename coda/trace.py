"""Trace events, sinks and the invariant checker (SPEC T1, T2, O1, L2, L3, L7, P2).

One trace row per fact: lifecycle transitions, every token selection with its decision record,
decode start/completion with the cache's logical length, stop-matcher state, every emitted byte
sequence number, the three cancel moments, resource releases and the terminal. ``check_trace``
verifies a trace of one or many requests against the invariants; ``coda trace check FILE`` runs
it over a JSONL file.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from coda.finish import REASONS_BY_VERSION, CancelCause
from coda.lifecycle import TERMINAL_STATES, TRANSITIONS, State
from coda.stops import STOP_RULE_VERSION

_log = logging.getLogger("coda.trace")

# Event kinds (the ``kind`` field of a row).
LIFECYCLE = "lifecycle"
PREFILL_STARTED = "prefill.started"
PREFILL_COMPLETED = "prefill.completed"
TOKEN_SELECTED = "token.selected"
DECODE_STARTED = "decode.started"
DECODE_COMPLETED = "decode.completed"
STOP_STATE = "stop.state"
STOP_HIT = "stop.hit"
GRAMMAR_FORCED = "grammar.forced_close"  # issue 13: steering to the closing path began
STREAM_DELTA = "stream.delta"
UTF8_TAIL_DROPPED = "utf8_tail.dropped"  # K2: an incomplete tail removed by utf8_tail="drop"
CANCEL_REQUESTED = "cancel.requested"
CANCEL_OBSERVED = "cancel.observed"
CANCEL_EFFECTIVE = "cancel.effective"
RESOURCE_ACQUIRED = "resource.acquired"
RESOURCE_RELEASED = "resource.released"
TERMINAL = "terminal"
ERROR = "error"


@dataclass(frozen=True)
class TraceEvent:
    """One row: ``kind`` names the fact, ``data`` carries its fields (JSON-able)."""

    request_id: str
    kind: str
    data: Mapping[str, Any] = field(default_factory=dict)
    ts_ns: int = field(default_factory=time.monotonic_ns)

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "kind": self.kind, "ts_ns": self.ts_ns,
                **dict(self.data)}

    @classmethod
    def from_dict(cls, row: Mapping[str, Any]) -> TraceEvent:
        data = {k: v for k, v in row.items() if k not in ("request_id", "kind", "ts_ns")}
        return cls(str(row["request_id"]), str(row["kind"]), data, int(row.get("ts_ns", 0)))


class TraceSink(Protocol):
    def record(self, event: TraceEvent) -> None: ...


class NullTraceSink:
    def record(self, event: TraceEvent) -> None:
        return None


class TraceHandle:
    """One request's binding to the trace sink: the L7 ``trace_handle`` resource.

    Every row about the request goes through it while it is open. Releasing it (:meth:`close`,
    the last of the request's releases) seals the request's trace: the handle's own release row
    is the last row written (:meth:`record_last`); a row offered afterwards is a bug of the
    caller, so it is not written but counted in ``late_rows`` and logged, and the trace on disk
    stays one that :func:`check_trace` accepts. It is itself a :class:`TraceSink`."""

    def __init__(self, sink: TraceSink, request_id: str) -> None:
        self.sink = sink
        self.request_id = request_id
        self.enabled = is_tracing(sink)
        self.rows = 0
        self.late_rows = 0
        self._open = True

    def record(self, event: TraceEvent) -> None:
        if not self._open:
            self.late_rows += 1
            _log.warning("trace of %s is closed; dropped a late %s row", self.request_id,
                         event.kind)
            return
        self.rows += 1
        self.sink.record(event)

    def close(self) -> dict[str, int]:
        """Seal the trace; returns what the release row reports (rows written so far)."""
        self._open = False
        return {"rows": self.rows}

    def record_last(self, event: TraceEvent) -> None:
        """The handle's own release row: written after :meth:`close`, and the last one."""
        self.rows += 1
        self.sink.record(event)


def is_tracing(sink: TraceSink) -> bool:
    """False for a sink that drops everything (callers skip building rows on the hot path)."""
    if isinstance(sink, TraceHandle):
        return sink.enabled
    return not isinstance(sink, NullTraceSink)


class ListTraceSink:
    """Keeps events in memory (tests, the reference loop)."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []
        self._lock = threading.Lock()

    def record(self, event: TraceEvent) -> None:
        with self._lock:
            self.events.append(event)

    def kinds(self, request_id: str | None = None) -> list[str]:
        return [e.kind for e in self.events if request_id is None or e.request_id == request_id]

    def of(self, request_id: str) -> list[TraceEvent]:
        return [e for e in self.events if e.request_id == request_id]


class JsonlTraceSink:
    """Appends one JSON object per line; thread-safe."""

    def __init__(self, path: str | Path) -> None:
        self._fh: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def record(self, event: TraceEvent) -> None:
        line = json.dumps(event.to_dict(), ensure_ascii=False, default=str)
        with self._lock:
            self._fh.write(line + "\n")
            self._fh.flush()

    def close(self) -> None:
        with self._lock:
            self._fh.close()


class RecentTraceSink:
    """The trace rows of the most recent requests, in memory and bounded (issue 13 item 3: the
    playground draws a request's timeline from them). ``max_requests`` requests are kept (the
    oldest dropped first), each with at most ``max_rows`` rows (later rows are counted, not
    kept, except the terminal row and cancel moments, which are always kept). Rows are also
    passed on to ``inner`` (e.g. a JSONL file) when given."""

    _ALWAYS = frozenset({"terminal", "cancel.requested", "cancel.observed", "cancel.effective",
                         "lifecycle"})

    def __init__(self, max_requests: int = 64, max_rows: int = 4096,
                 inner: TraceSink | None = None) -> None:
        self.max_requests, self.max_rows = max_requests, max_rows
        self.inner = inner
        self._rows: OrderedDict[str, list[TraceEvent]] = OrderedDict()
        self._dropped: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, event: TraceEvent) -> None:
        with self._lock:
            rows = self._rows.get(event.request_id)
            if rows is None:
                rows = self._rows[event.request_id] = []
                while len(self._rows) > self.max_requests:
                    old, _ = self._rows.popitem(last=False)
                    self._dropped.pop(old, None)
            if len(rows) < self.max_rows or event.kind in self._ALWAYS:
                rows.append(event)
            else:
                self._dropped[event.request_id] = self._dropped.get(event.request_id, 0) + 1
        if self.inner is not None:
            self.inner.record(event)

    def rows(self, request_id: str) -> tuple[list[TraceEvent], int] | None:
        """(rows kept, rows dropped past the bound) of one request, or None if not kept."""
        with self._lock:
            rows = self._rows.get(request_id)
            return None if rows is None else (list(rows), self._dropped.get(request_id, 0))


def read_jsonl(path: str | Path) -> list[TraceEvent]:
    with open(path, encoding="utf-8") as fh:
        return [TraceEvent.from_dict(json.loads(line)) for line in fh if line.strip()]


_AFTER_TERMINAL_ALLOWED = frozenset({RESOURCE_RELEASED, ERROR})


def check_trace(events: Iterable[TraceEvent]) -> list[str]:
    """Return every invariant violation found (empty list = the trace is sound).

    Per request: lifecycle transitions follow the graph (L1); exactly one terminal and only
    resource releases after it (L2, L3); stream sequence numbers strictly increasing (P2);
    selected − decoded ∈ {0, 1} at every point (T1); no selection after a cancel was observed
    (C3, T2); every acquired resource released exactly once (L7); the terminal row names a
    known finish-reason enum version whose members include its reason, and a known stop
    tie-rule version, as does every stop.hit row (L4, S4).
    """
    by_req: dict[str, list[TraceEvent]] = defaultdict(list)
    for ev in events:
        by_req[ev.request_id].append(ev)
    problems: list[str] = []
    for rid, evs in by_req.items():
        problems.extend(f"{rid}: {p}" for p in _check_one(evs))
    return problems


def _check_one(evs: list[TraceEvent]) -> list[str]:
    out: list[str] = []
    state = State.CREATED
    terminals = 0
    last_seq = -1
    selected = decoded = 0
    cancel_observed = False
    acquired: dict[str, int] = defaultdict(int)
    released: dict[str, int] = defaultdict(int)
    for ev in evs:
        if terminals and ev.kind not in _AFTER_TERMINAL_ALLOWED:
            out.append(f"{ev.kind} after the terminal event")
        if ev.kind == LIFECYCLE:
            frm, to = State(ev.data["from"]), State(ev.data["to"])
            if frm != state or to not in TRANSITIONS[frm]:
                out.append(f"illegal transition {frm.value}->{to.value} (state was {state.value})")
            state = to
        elif ev.kind == TERMINAL:
            terminals += 1
            if terminals > 1:
                out.append("more than one terminal event")
            if state not in TERMINAL_STATES:
                out.append(f"terminal event while state is {state.value}")
            seq = ev.data.get("seq")
            if isinstance(seq, int):
                if seq <= last_seq:
                    out.append(f"terminal seq {seq} not after {last_seq}")
                last_seq = seq
            out.extend(_check_versions(ev))
        elif ev.kind == STOP_HIT:
            out.extend(_check_stop_rule(ev))
        elif ev.kind == STREAM_DELTA:
            seq = int(ev.data["seq"])
            if seq <= last_seq:
                out.append(f"sequence number {seq} not greater than {last_seq}")
            last_seq = seq
        elif ev.kind == TOKEN_SELECTED:
            if cancel_observed:
                out.append("token selected after cancel was observed")
            selected += 1
            if selected - decoded not in (0, 1):
                out.append(f"selected {selected} vs decoded {decoded}")
        elif ev.kind == DECODE_COMPLETED:
            decoded += 1
            if selected - decoded not in (0, 1):
                out.append(f"decoded {decoded} exceeds selected {selected}")
        elif ev.kind == CANCEL_OBSERVED:
            cancel_observed = True
        elif ev.kind == RESOURCE_ACQUIRED:
            acquired[str(ev.data["resource"])] += 1
        elif ev.kind == RESOURCE_RELEASED:
            released[str(ev.data["resource"])] += 1
    if terminals == 0:
        out.append("no terminal event")
    out.extend(_check_failure_rows(evs))
    for kind in set(acquired) | set(released):
        if acquired[kind] != 1 or released[kind] != 1:
            out.append(f"resource {kind}: acquired {acquired[kind]}x, released {released[kind]}x")
    return out


KNOWN_STOP_RULE_VERSIONS = frozenset({STOP_RULE_VERSION})


def _check_stop_rule(ev: TraceEvent) -> list[str]:
    rule = ev.data.get("stop_rule_version")
    if rule not in KNOWN_STOP_RULE_VERSIONS:
        return [f"{ev.kind}: unknown or missing stop_rule_version {rule!r} (S4)"]
    return []


def _check_versions(ev: TraceEvent) -> list[str]:
    """L4/S4: the terminal row says which enum and tie rule decided it, and its reason is a
    member of that enum version."""
    out = _check_stop_rule(ev)
    version = ev.data.get("finish_reason_version")
    members = REASONS_BY_VERSION.get(version) if isinstance(version, int) else None
    if members is None:
        out.append(f"terminal: unknown or missing finish_reason_version {version!r} (L4)")
    elif ev.data.get("reason") not in members:
        out.append(f"terminal: reason {ev.data.get('reason')!r} is not in finish-reason "
                   f"enum version {version} (L4)")
    return out


def _check_failure_rows(evs: list[TraceEvent]) -> list[str]:
    """The §4.12 failure rows a trace can show (O2): EOS returned as text (row 1), a stop
    string on the stream before its hit (row 2), a cancel reported as another reason, such as
    a disconnect as eos (row 6). Rows 3, 4 and 7 are the T1, L2 and P2 checks above."""
    out: list[str] = []
    text = "".join(str(e.data.get("text", "")) for e in evs if e.kind == STREAM_DELTA)
    # NOTE: an early stop's cancel row names its own reason (D6); other causes map one to one
    cancels = [(str(e.data.get("cause")), e.data.get("reason"))
               for e in evs if e.kind == CANCEL_REQUESTED]
    for ev in evs:
        if ev.kind == STOP_HIT and ev.data.get("which") == "string":
            stop = str(ev.data.get("stop"))
            # NOTE: include_stop_str_in_output may end the text with it, never show it earlier;
            # an occurrence completed in the bytes before ``armed_at`` (min_tokens) is text
            sent, pat = text.encode(), stop.encode()
            at = max(0, int(ev.data.get("armed_at", 0)) - len(pat) + 1)
            if 0 <= sent.find(pat, at) < len(sent) - len(pat):
                out.append(f"stop string {stop!r} reached the stream before its hit")
        elif ev.kind == TERMINAL:
            usage = ev.data.get("usage") or {}
            selected = int(usage.get("selected_tokens", 0))
            returned = int(usage.get("returned_tokens", 0))
            if ev.data.get("reason") == "eos" and selected and returned >= selected:
                out.append("eos terminal but every selected token was returned: EOS shown")
            if ev.data.get("state") == State.CANCELLED.value and cancels:
                cause, named = cancels[0]
                want = named or CancelCause(cause).finish_reason.value
                if ev.data.get("reason") != want:
                    out.append(f"cancel by {cause} reported as {ev.data.get('reason')}, "
                               f"not {want}")
    return out
