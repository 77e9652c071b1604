"""The parent's copy of a request's stream in a model worker (issue 23 item 1; SPEC P1, P6).

:class:`coda.engine.process_engine.WorkerProcess` appends the worker's events to it in seq
order (``RequestStream.extend``: a duplicate skipped, a gap refused), so its seq numbers are the
worker's own; the server's readers read it as if the engine were in process, and their
acknowledgements travel back to the worker's stream, whose bound is the request's (P6).
"""

from __future__ import annotations

from collections.abc import Callable

from coda.stream import RequestStream
from coda.stream_backpressure import BackpressureConfig

__all__ = ["WorkerCopy"]

# NOTE: the worker's own stream enforces the request's bound (acks travel back); the copy
# must never refuse what the worker produced
_UNBOUNDED = BackpressureConfig(pause_bytes=1 << 62, max_bytes=1 << 62)


class WorkerCopy(RequestStream):
    """The parent's copy of a request's stream; acknowledging it acknowledges the worker's
    stream (P6: the credit the request pauses or overflows on is the client's)."""

    def __init__(self, request_id: str, on_ack: Callable[[str, int], None]) -> None:
        super().__init__(request_id, _UNBOUNDED)
        self.on_ack = on_ack
        self.acked_to_worker = -1

    def ack(self, seq: int) -> None:
        super().ack(seq)
        if seq > self.acked_to_worker:
            self.acked_to_worker = seq
            self.on_ack(self.request_id, seq)
