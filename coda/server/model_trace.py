"""The trace of a several-model server (issue 23 item 1; SPEC O1): the server's own rows (a
model's ``model.load`` / ``model.loaded`` / ``model.unload``, a request's ``model.wait`` and
``model.ready``) kept as recent requests' rows, merged, when a request's rows are read
(``GET /v1/traces/{id}``), with the rows the worker that ran it wrote. Held by
:class:`~coda.server.model_router.ModelRouter` as its ``trace``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coda.trace import RecentTraceSink, TraceEvent, TraceSink

if TYPE_CHECKING:
    from coda.server.model_router import ModelRouter


class RouterTrace(RecentTraceSink):
    """The server's trace: its own rows (model loads, waits) merged, when read, with the
    rows of the worker that ran the request (``GET /v1/traces/{id}``)."""

    def __init__(self, router: ModelRouter, max_requests: int,
                 inner: TraceSink | None) -> None:
        super().__init__(max_requests, inner=inner)
        self.router = router

    def rows(self, request_id: str) -> tuple[list[TraceEvent], int] | None:
        """Blocking (a call to the worker): read it off the event loop."""
        own = super().rows(request_id)
        mine, dropped = own if own is not None else ([], 0)
        theirs: list[TraceEvent] = []
        h = self.router._handles.get(request_id)
        w = h.worker if h is not None else None
        if w is not None and w.state == "ready":
            try:
                got = w.call("trace_rows", request_id)
            except TimeoutError:
                got = None
            theirs = [TraceEvent.from_dict(r) for r in got or []]
        if own is None and not theirs:
            return None
        return sorted(mine + theirs, key=lambda e: e.ts_ns), dropped
