"""Reading a request's trace as a client does (SPEC O1): ``GET /v1/traces/{id}``, every row
present, read back by the product's own reader of that answer (coda.trace.served_rows, what
``coda trace check`` runs on a saved one)."""

from __future__ import annotations

import httpx

from coda.trace import TraceEvent, served_rows
from tests.conftest import LiveServer


def served_trace(live: LiveServer, request_id: str) -> list[TraceEvent]:
    """``request_id``'s rows as the endpoint serves them; none dropped by the bounded sink."""
    resp = httpx.get(f"{live.url}/v1/traces/{request_id}", timeout=30)
    assert resp.json()["dropped_rows"] == 0
    rows = served_rows(resp.text)
    assert rows is not None
    return rows
