"""Ending a request in the parent, without the engine that ran it (SPEC L2, L5, L6, C1; D5
"committed tokens are billed in every case"): a worker process that died under it
(:mod:`coda.engine.process_engine`), or a request cancelled or refused before any engine saw
it (:mod:`coda.server.model_router`). One terminal: ``close`` refuses a second.

Billing a request the worker died under (L6, D5 "committed tokens are billed in every case").
The worker's engine would have billed every token it selected, including those no delta
carried yet (held back by a stop string or a partial stop-id sequence, bytes the detokenizer
still held, a token selected after the last delta); the parent sees only deltas. So with each
batch of events, and every ``process_sender._REPORT_S`` (20 ms) while tokens move no event,
the worker sends the request's counts (:meth:`coda.request.RequestRun.live_usage`), and the
local ending bills:

- ``returned_bytes``: the bytes of the deltas that reached the parent (what the client got);
- ``returned_tokens``: the worker's count as of exactly those bytes (its report's returned
  bytes equal them; a report that does not match falls back to the tokens the deltas carried);
- ``selected_tokens``, ``processed_*``, ``cached_prompt_tokens``: the worker's last report —
  the tokens the client was shown plus those generated and held — and never fewer selected
  tokens than the deltas carried.

Exact up to the worker's last message: a token selected after it (at most about 20 ms
before the death) is known to no surviving process and is not billed.
"""

from __future__ import annotations

from coda.errors import ErrorCode
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.stream import EventType, RequestStream, StreamClosed, StreamEvent


def local_usage(prompt_tokens: int, evs: list[StreamEvent], reported: Usage | None) -> Usage:
    """What a request ended here bills (the module docstring): the deltas ``evs`` hold, and
    the worker's last ``reported`` counts (None: no report came)."""
    committed = sum(len(e.tokens) for e in evs if e.type is EventType.DELTA)
    shown = sum(len(e.data) for e in evs)
    if reported is None:
        return Usage(prompt_tokens=prompt_tokens, selected_tokens=committed,
                     processed_output_tokens=committed, returned_tokens=committed,
                     returned_bytes=shown)
    returned = reported.returned_tokens if reported.returned_bytes == shown else committed
    return Usage(prompt_tokens=prompt_tokens, cached_prompt_tokens=reported.cached_prompt_tokens,
                 selected_tokens=max(reported.selected_tokens, committed),
                 processed_prompt_tokens=reported.processed_prompt_tokens,
                 processed_output_tokens=reported.processed_output_tokens,
                 returned_tokens=returned, returned_bytes=shown)


def end_locally(stream: RequestStream, model: str, prompt_tokens: int, terminal: Terminal,
                reported: Usage | None = None) -> bool:
    """Close ``stream`` here with ``terminal`` (after a start event if it has none), billing
    :func:`local_usage`; False when it already had its terminal (L2: one ending)."""
    try:
        if stream.last_seq < 0:
            stream.start(model)
        evs = stream.events_after(-1)
        usage = local_usage(prompt_tokens, evs, reported)
        stream.close(Terminal(terminal.state, terminal.finish_reason, usage,
                              terminal.error_code, terminal.error_message,
                              **terminal.timings(),
                              model_snapshot=evs[0].model_snapshot if evs else None))
        return True
    except StreamClosed:
        return False


def end_failed(stream: RequestStream, model: str, prompt_tokens: int, message: str,
               code: ErrorCode = ErrorCode.MODEL_ERROR, waited_s: float = 0.0,
               reported: Usage | None = None) -> bool:
    """End ``stream`` FAILED ``model_error`` (L5) with ``code`` and ``message``; ``reported``:
    the worker's last billing report, if it ran the request."""
    return end_locally(stream, model, prompt_tokens, Terminal(
        State.FAILED, FinishReason.MODEL_ERROR, Usage(), code, message,
        queue_s=waited_s, total_s=waited_s), reported)


def end_cancelled(stream: RequestStream, model: str, prompt_tokens: int,
                  reason: FinishReason, waited_s: float = 0.0) -> bool:
    """End ``stream`` CANCELLED with ``reason`` (a cancel cause's, or ``deadline_exceeded``)
    before any engine saw it."""
    return end_locally(stream, model, prompt_tokens, Terminal(
        State.CANCELLED, reason, Usage(), queue_s=waited_s, total_s=waited_s))
