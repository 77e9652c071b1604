"""What makes a replayed stream byte-identical to the live one (issue 14 item 2; SPEC P3, P5).

A client that dedupes by (request id, sequence number) must receive the same event whether it
came live or from a replay. Two things used to differ:

- **Per-delivery measurements.** ``coda.timings.network_send_s`` is measured by the transport
  while the live stream is written. :class:`DeliveryRecord` fixes it once per choice, the first
  time any reader renders that choice's terminal, and every later rendering (a replay, a second
  reader) reads the recorded value instead of measuring its own delivery.
- **The interleaving of n > 1 choices.** :func:`coda.reader.merge_order` is the one order in which events
  of several streams are rendered: by creation time, then choice index, then sequence number.
  It is a function of the logs alone, so the live reader and a replay from any cut agree.

::

    live:    s0:start s1:start s0:d1 s1:d1 s1:d2 s0:d2 ...   (ts order)
    cut at "2,1" (after s0:d1): replay = every event with seq > cut, in the same order
"""

from __future__ import annotations

import threading


class DeliveryRecord:
    """First-delivery measurements of one API request, keyed by choice index (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._send_s: dict[int, float] = {}

    def network_send_s(self, index: int, measured: float) -> float:
        """The recorded network send time of choice ``index``; ``measured`` becomes the record
        if this is the first rendering of that terminal."""
        with self._lock:
            return self._send_s.setdefault(index, round(measured, 6))
