"""Reading a request's trace as a client does (SPEC O1): ``GET /v1/traces/{id}``, every row
present, read back by the product's own reader of that answer (coda.trace.served_rows, what
``coda trace check`` runs on a saved one)."""

from __future__ import annotations

import time

import httpx

from coda import trace as tr
from coda.trace import ListTraceSink, TraceEvent, served_rows
from tests.conftest import LiveServer


def served_trace(live: LiveServer, request_id: str) -> list[TraceEvent]:
    """``request_id``'s rows as the endpoint serves them; none dropped by the bounded sink."""
    resp = httpx.get(f"{live.url}/v1/traces/{request_id}", timeout=30)
    assert resp.json()["dropped_rows"] == 0
    rows = served_rows(resp.text)
    assert rows is not None
    return rows


def sealed_rows(sink: ListTraceSink, request_id: str) -> list[TraceEvent]:
    """The request's rows once its trace handle's release (its last row) is written: the
    terminal row and the stream's releases follow the stream's close, which wakes ``wait``."""
    deadline = time.monotonic() + 30
    while True:
        rows = sink.of(request_id)
        last = rows[-1] if rows else None
        if last is not None and last.kind == tr.RESOURCE_RELEASED and \
                last.data.get("resource") == "trace_handle":
            return rows
        assert time.monotonic() < deadline, "the request's trace was never sealed"
        time.sleep(0.01)
