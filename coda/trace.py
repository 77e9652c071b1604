"""Trace events and sinks (SPEC O1); the invariant checker is :mod:`coda.trace_check`.

One trace row per fact: lifecycle transitions, every token selection with its decision record,
decode start/completion with the cache's logical length, stop-matcher state, every emitted byte
sequence number, the three cancel moments, resource releases, each preemption of the request's
K/V and its recompute, and the terminal.
:func:`check_trace` (rules in :mod:`coda.trace_check`) verifies a trace of one or many requests
against the invariants; ``coda trace check FILE`` runs it over a JSONL file.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

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
REASONING_SPLIT = "reasoning.split"  # issue 23, K2: a reasoning marker removed (coda.reasoning)
CANCEL_REQUESTED = "cancel.requested"
CANCEL_OBSERVED = "cancel.observed"
CANCEL_EFFECTIVE = "cancel.effective"
RESOURCE_ACQUIRED = "resource.acquired"
RESOURCE_RELEASED = "resource.released"
TERMINAL = "terminal"
ERROR = "error"
# issue 21: one speculative verification (drafted = accepted + rejected; t = the first output
# position it verified); transparent to the step order (coda.engine.speculative)
SPECULATIVE = "speculative.verify"

# T4, O1: the scheduler dropped the request's K/V blocks to free room (preemption by recompute;
# ``t`` selected, ``cache_len`` tokens dropped), then gave it blocks again and recomputes
# ``recompute`` tokens (``cached`` reused from the prefix cache). Not a release and acquisition of
# the ``kv_cache`` resource (L7: that one is released once, at the ending): the request keeps
# its claim on the cache while it waits (coda.lifecycle.Lifecycle.preempt)
KV_PREEMPTED = "kv.preempted"
KV_REACQUIRED = "kv.reacquired"

# issue 12/24, O2: a replica router's decision (coda.scaleout), checked by coda.trace_route
ROUTE_DECIDED = "route.decided"

# Responses ``truncation: "auto"`` dropped input items at admission (coda.server.responses_fit):
# a server row before the engine's, left alone by the checker
INPUT_TRUNCATED = "input.truncated"

# The kinds the engine's rules know (coda.trace_check); ``route.decided`` rows are checked on
# their own (coda.trace_route), other kinds are left alone.
KNOWN_KINDS = frozenset({
    LIFECYCLE, PREFILL_STARTED, PREFILL_COMPLETED, TOKEN_SELECTED, DECODE_STARTED,
    DECODE_COMPLETED, STOP_STATE, STOP_HIT, GRAMMAR_FORCED, STREAM_DELTA, UTF8_TAIL_DROPPED,
    REASONING_SPLIT, CANCEL_REQUESTED, CANCEL_OBSERVED, CANCEL_EFFECTIVE, RESOURCE_ACQUIRED, RESOURCE_RELEASED,
    TERMINAL, ERROR, SPECULATIVE, KV_PREEMPTED, KV_REACQUIRED})


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
        """A row as :meth:`to_dict` wrote it; one with no ``ts_ns`` reads as 0, "not recorded"
        (the O1 order rule's floor), never the reader's "now": two reads of a file agree."""
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
        if self._admit(event.kind):
            self.sink.record(event)

    def emit(self, kind: str, data: Mapping[str, Any], *, last: bool = False) -> None:
        """A row about this request, stamped with the handle's id: built only where the sink
        keeps rows (a null sink's rows are counted, never built). ``last``: the handle's own
        release row, written after :meth:`close` (see :meth:`record_last`)."""
        if last:
            self.rows += 1
        elif not self._admit(kind):
            return
        if self.enabled:
            self.sink.record(TraceEvent(self.request_id, kind, data))

    def _admit(self, kind: str) -> bool:
        """Count a row offered while open; a late one is dropped, counted and logged."""
        if not self._open:
            self.late_rows += 1
            _log.warning("trace of %s is closed; dropped a late %s row", self.request_id, kind)
            return False
        self.rows += 1
        return True

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


class TraceReadError(ValueError):
    """A trace file row that is no trace row; the message names its line and why."""


def read_jsonl(path: str | Path, cut: list[TraceReadError] | None = None) -> list[TraceEvent]:
    """The rows of a JSONL trace file; a row that is no trace row raises TraceReadError naming its
    line (a server killed mid-write leaves a cut last line: the message says which). With
    ``cut``, a cut last line (no newline, no whole JSON value: a writer killed mid-row, whose
    rows are each one write ending in one) is left out and its error appended there instead.
    A file holding one ``GET /v1/traces/{id}`` answer (as saved, in one line or indented) is
    read as that request's rows: :func:`served_rows`."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    served = served_rows(text)
    if served is not None:
        return served
    rows = []
    for number, line in enumerate(text.splitlines(keepends=True), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):  # NOTE: ``[1, 2]`` was an AttributeError traceback
                raise TypeError(f"a row is a JSON object, not {type(row).__name__}")
            rows.append(TraceEvent.from_dict(row))
        except (ValueError, KeyError, TypeError) as exc:
            # NOTE: json's own position is within the row ("line 1 column 103"), not the file
            err = TraceReadError(f"line {number}: {type(exc).__name__}: {exc}")
            # NOTE: only the last line can be cut, and a cut one is no whole JSON value (a
            # whole object that is no row, e.g. another document, is unreadable, not cut)
            if cut is not None and not line.endswith("\n") and \
                    isinstance(exc, json.JSONDecodeError):
                cut.append(err)
                return rows
            raise err from exc
    return rows


def served_rows(text: str) -> list[TraceEvent] | None:
    """The rows of a ``GET /v1/traces/{id}`` answer (``{"request_id", "dropped_rows",
    "rows": [{"kind", "t_ms", ...}]}``) as the sink wrote them (``ts_ns`` from ``t_ms``, which
    keeps their order); None when ``text`` is not one such answer. Rows the bounded sink
    dropped (``dropped_rows``) are missing, so the checker's row count (O1) tells."""
    head = text.lstrip()[:1]
    if head != "{":
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None  # NOTE: JSONL (several values) or a cut file: read line by line
    if not (isinstance(doc, dict) and "kind" not in doc and isinstance(doc.get("rows"), list)
            and isinstance(doc.get("request_id"), str)):
        return None
    rid = doc["request_id"]
    try:
        return [TraceEvent(rid, str(row["kind"]),
                           {k: v for k, v in row.items() if k not in ("kind", "t_ms")},
                           round(float(row["t_ms"]) * 1e6)) for row in doc["rows"]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TraceReadError(f"a /v1/traces answer with a row that is no trace row: "
                             f"{type(exc).__name__}: {exc}") from exc


def check_trace(events: Iterable[TraceEvent]) -> list[str]:
    """Every invariant violation in a trace (empty list = sound); the rules live in
    :mod:`coda.trace_check` (their one home), imported lazily because it builds on this module."""
    from coda.trace_check import check_trace as check

    return check(events)
