"""The routing decision in the request's trace (issue 12 item 1; SPEC O2).

Each decision of the ingress — the replica chosen, why (``least_outstanding_tokens``,
``prefix_affinity``, ``retry_after_failure``) and the outstanding tokens it saw per replica —
is a ``route.decided`` row. The replica writes it as the first row of the request's trace (its
JSONL file for ``coda trace``, its in-memory trace); the ingress keeps its own copy, so
``GET /v1/traces/{id}`` on the ingress shows every decision (a resubmit's too, even when the
first replica is gone) merged with the rows of the replica that ran the request.
"""

from __future__ import annotations

import logging
from typing import Any

from coda.trace import ROUTE_DECIDED, RecentTraceSink, TraceEvent

__all__ = ["ROUTE_DECIDED", "RoutedTraceSink"]

log = logging.getLogger("coda.scaleout")


class RoutedTraceSink(RecentTraceSink):
    """The ingress's trace: its routing rows, plus (when read) the replica's rows."""

    def __init__(self, engine: Any, max_requests: int) -> None:
        super().__init__(max_requests)
        self.engine = engine
        self._where: dict[str, int] = {}

    def routed(self, request_id: str, route: dict[str, Any]) -> None:
        self._where[request_id] = int(route["replica"])
        while len(self._where) > self.max_requests:
            self._where.pop(next(iter(self._where)))
        self.record(TraceEvent(request_id, ROUTE_DECIDED, dict(route)))

    def rows(self, request_id: str) -> tuple[list[TraceEvent], int] | None:
        """Blocking (a Ray call): read it off the event loop."""
        own = super().rows(request_id)
        if own is None:
            return None
        mine, dropped = own
        theirs: list[TraceEvent] = []
        idx = self._where.get(request_id)
        if idx is not None:
            try:
                got = self.engine.replicas[idx].trace_rows.remote(request_id).result(
                    timeout_s=10)
            except Exception:  # NOTE: the replica may be gone; the ingress's rows remain
                log.warning("replica trace unavailable", extra={"request_id": request_id})
                got = None
            theirs = [TraceEvent.from_dict(r) for r in got or [] if r["kind"] != ROUTE_DECIDED]
        return sorted(mine + theirs, key=lambda e: e.ts_ns), dropped
