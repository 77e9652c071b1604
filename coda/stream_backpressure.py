"""A stream's backpressure policy, declared per stream (SPEC P6).

1. ``PAUSE`` — past ``pause_bytes`` of unacknowledged output, ``should_pause`` tells the
   scheduler to stop stepping this request until the reader catches up;
2. ``BUFFER`` — keep generating into the buffer;
3. in both, the buffer is bounded by ``max_bytes``: a delta that would pass it raises
   :class:`~coda.errors.BackpressureOverflowError` (nothing is dropped silently) and the owner
   ends the request with that error. Never an unbounded buffer, never a complete text claimed
   after a dropped delta.

The checks themselves are the log's (:class:`coda.stream.RequestStream`: ``delta``, ``ack``,
``should_pause``); this module is the declaration a request carries (its plan, its durable
record) and the default a stream takes when it declares none.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class BackpressurePolicy(StrEnum):
    PAUSE = "pause"
    BUFFER = "buffer"


@dataclass(frozen=True)
class BackpressureConfig:
    policy: BackpressurePolicy = BackpressurePolicy.BUFFER
    pause_bytes: int = 64 * 1024
    max_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        if not 0 < self.pause_bytes <= self.max_bytes:
            raise ValueError("need 0 < pause_bytes <= max_bytes")


DEFAULT_BACKPRESSURE = BackpressureConfig()
"""A stream's policy when its request declares none (frozen: one value shared by all)."""
