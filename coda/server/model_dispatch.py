"""A request routed to a model (issue 23 item 1; SPEC C1, G3, L2, L5, O1): its handle, and its
way to its model's worker. The handle is returned at once; a model that is not loaded yet is
loaded (:mod:`coda.server.model_loads`) while the request waits, with its deadline (G3:
``deadline_exceeded`` if it passes first; a cancel ends it ``cancelled``, C1). A failed load
ends it once, FAILED ``model_error`` naming the model (L2, L5; never a transport error), and is
counted before it ends (``coda:model_loads``). A wait is written to the trace (``model.wait``,
then ``model.ready``, O1). An embedding waits for the load the same way. Used by
:class:`~coda.server.model_router.ModelRouter` (the module docstring there has the whole
picture).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from coda.engine.local_end import end_cancelled, end_failed
from coda.engine.process_copy import WorkerCopy
from coda.engine.process_engine import WorkerProcess
from coda.engine.types import GenerationRequest
from coda.finish import CancelCause, FinishReason
from coda.reader import StreamReading
from coda.server.model_slot import ModelSlot
from coda.trace import TraceEvent

if TYPE_CHECKING:
    from coda.server.model_router import ModelRouter

_POLL_S = 0.02  # NOTE: how often a waiting request looks at its model's load


@dataclass
class RoutedHandle(StreamReading):
    """An :class:`~coda.engine.protocol.EngineHandle` of a request routed to a model."""

    request_id: str
    stream: WorkerCopy
    prompt_tokens: int
    slot: ModelSlot
    arrival: float
    worker: WorkerProcess | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        """C1: before the request reached a worker it ends here (once: ``close`` refuses a
        second terminal); after, the worker's engine ends it."""
        with self.lock:
            if self.stream.closed:
                return False
            if self.worker is None:
                return end_cancelled(self.stream, self.slot.name, self.prompt_tokens,
                                     cause.finish_reason, time.monotonic() - self.arrival)
            worker = self.worker
        worker.cancel(self.request_id, cause)
        return True


async def dispatch(router: ModelRouter, slot: ModelSlot, h: RoutedHandle,
                   req: GenerationRequest) -> None:
    """Wait for ``slot``'s model (loading it if nobody has), then hand ``req`` to its worker
    with what is left of its deadline; or end it here (deadline, failed load)."""
    deadline = h.arrival + req.deadline_s if req.deadline_s is not None else None
    waited_on: WorkerProcess | None = None
    while True:
        if h.stream.closed:
            return
        w = slot.worker
        if w is not None and w.state == "ready":
            break
        if waited_on is not None and waited_on.state in ("failed", "exited"):
            router.loads.exited(slot, waited_on)  # NOTE: counted before the request ends
            fail(h, f"model '{slot.name}' could not be loaded: {waited_on.error}")
            return
        if w is None:
            with router.loads.lock:
                problem = router.loads.try_load(slot) if slot.worker is None else None
            if problem is not None:
                fail(h, problem)
                return
        if waited_on is None and slot.worker is not None:
            waited_on = slot.worker
            router.metrics.waits.labels(model=slot.name).inc()
            router.trace.record(TraceEvent(h.request_id, "model.wait",
                                           {"model": slot.name, "status": slot.status}))
        if deadline is not None and time.monotonic() >= deadline:
            end_cancelled(h.stream, slot.name, h.prompt_tokens,
                          FinishReason.DEADLINE_EXCEEDED, time.monotonic() - h.arrival)
            return
        await asyncio.sleep(_POLL_S)
    if waited_on is not None:
        router.trace.record(TraceEvent(h.request_id, "model.ready", {
            "model": slot.name, "waited_ms": (time.monotonic() - h.arrival) * 1e3}))
    if deadline is not None:
        # NOTE: the worker's engine counts the deadline from its own arrival: what is left
        req = replace(req, deadline_s=max(deadline - time.monotonic(), 1e-6))
    with h.lock:  # NOTE: a cancel either ended it already or goes to this worker after
        if h.stream.closed:
            return
        h.worker = w
        w.submit(req, h.stream)


async def embed(router: ModelRouter, slot: ModelSlot, token_ids: list[int]) -> list[float]:
    """:meth:`ModelRouter.embed <coda.server.model_router.ModelRouter.embed>` on ``slot``."""
    from coda.engine.plan import check_embedding_input
    from coda.errors import EngineNotStartedError

    check_embedding_input(token_ids, slot.context_length)
    waited_on: WorkerProcess | None = None
    while (w := slot.worker) is None or w.state != "ready":
        if waited_on is not None and waited_on.state in ("failed", "exited"):
            router.loads.exited(slot, waited_on)
            raise EngineNotStartedError(
                f"model '{slot.name}' could not be loaded: {waited_on.error}")
        if w is None:
            with router.loads.lock:
                problem = router.loads.try_load(slot) if slot.worker is None else None
            if problem is not None:
                raise EngineNotStartedError(problem)
        waited_on = waited_on or slot.worker
        await asyncio.sleep(_POLL_S)
    key = f"embed-{uuid.uuid4().hex[:16]}"
    slot.live.add(key)  # NOTE: in flight: not unloaded under it
    try:
        # NOTE: a cancelled await (the client gone) cancels it in the worker too (C1)
        return await asyncio.wrap_future(w.embed(token_ids))
    finally:
        slot.live.discard(key)
        slot.last_used = time.monotonic()


def fail(h: RoutedHandle, message: str) -> None:
    """End ``h`` FAILED ``model_error`` with ``message``, unless a worker has it."""
    with h.lock:
        if h.worker is None:
            end_failed(h.stream, h.slot.name, h.prompt_tokens, message,
                       waited_s=time.monotonic() - h.arrival)
