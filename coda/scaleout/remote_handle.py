"""A request's handle on a replica and its cancel (issue 12 item 1; SPEC C1, P4).

:class:`RemoteHandle` is the :class:`~coda.engine.protocol.EngineHandle` the ingress's
:class:`~coda.scaleout.remote.RemoteEngine` returns: its stream is fed from the replica it was
routed to (``replica``, the decision in ``route``). Its cancel is recorded in the durable log
first, when there is one (a cancel that overtakes the replica's claim), then sent to the
replica; the Serve calls are resolved off the event loop (:func:`resolve_calls`), since a call
left unresolved may not be delivered.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from coda.finish import CancelCause
from coda.reader import StreamReading
from coda.stream import RequestStream

if TYPE_CHECKING:
    from coda.scaleout.remote import RemoteEngine

__all__ = ["RemoteHandle", "resolve_calls"]

log = logging.getLogger("coda.scaleout")


@dataclass
class RemoteHandle(StreamReading):
    """An :class:`~coda.engine.protocol.EngineHandle` whose events come from a replica."""

    request_id: str
    stream: RequestStream
    prompt_tokens: int
    engine: RemoteEngine
    route: dict[str, Any] = field(default_factory=dict)
    replica: int = -1
    detach: bool = False  # NOTE: runs on without a client (background): the log says so

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        if self.stream.closed or self.replica < 0:
            return False
        self.engine.mark_cancel(self.request_id, cause)
        call = self.engine.replicas[self.replica].cancel.remote(self.request_id, cause)
        # NOTE: resolved off the event loop, as cancel_anywhere's (a Serve call left
        # unresolved may not be delivered)
        threading.Thread(target=resolve_calls, args=([call],), daemon=True).start()
        return True


def resolve_calls(calls: list[Any]) -> None:
    for call in calls:
        try:
            call.result(timeout_s=30)
        except Exception:  # NOTE: a dead replica: nothing of the request is left there
            log.warning("cancel not delivered to a replica", exc_info=True)
