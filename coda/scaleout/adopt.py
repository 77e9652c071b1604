"""A surviving front end adopts the detached requests of a dead one (SPEC P4, L2, L5; "nothing
accepted is lost"; the rules: :mod:`coda.durable.orphans`).

An ingress opens every request it routes with what it sends the replica (:func:`stored`: the
:class:`~coda.engine.types.GenerationRequest` and when it was accepted). If it dies before any
replica claimed a detached one (background, ``on_disconnect=continue``), the reaper of a front
end serving the same model calls :meth:`Adopter.__call__`: one fenced script makes this front
end the request's ingress (a replica's claim, a reaper or another adopter racing it leaves
exactly one winner), then the request is submitted here as if just accepted, detached (a
replica claims it from this front end; a replica failure is retried as any other's), its
deadline what was left of it. Its copy here is read only to acknowledge it (P6): its client
reads it by id from the log on any front end. Adopted requests run on their own event loop
thread, so a front end adopts whether or not it has served a request itself.

The stored request is typed, versioned JSON (:mod:`coda.durable.request_codec`), never a
pickle: the log is a shared store, and whoever can write to that Redis could otherwise run
code in every front end that adopts. One this front end cannot read (another version, a field
of the wrong type, a pickle) is refused, never executed: it is left to a front end that reads
it for the grace, then ends ``FAILED`` / ``transport_error`` as one with nothing stored does
(:mod:`coda.durable.orphans`; L5).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from coda.durable.request_codec import StoredRequestError, decode_stored, encode_stored
from coda.engine.types import GenerationRequest
from coda.reader import follow

if TYPE_CHECKING:
    from coda.durable.redis_log import RedisStreamLog
    from coda.scaleout.remote import RemoteEngine

log = logging.getLogger("coda.scaleout")


def stored(req: GenerationRequest) -> bytes:
    """What the ingress keeps in the request's meta (``req``) for an adopter; empty (nothing
    to adopt from: the orphan then ends ``transport_error``) for a request JSON cannot carry
    exactly (a NaN, an object no client could send: the engine refuses those anyway)."""
    try:
        return encode_stored(req, time.time())
    except (ValueError, TypeError):
        log.warning("request not stored for adoption: not encodable", exc_info=True,
                    extra={"request_id": req.request_id})
        return b""


def open_routed(dlog: RedisStreamLog, req: GenerationRequest, detached: bool, model: str
                ) -> None:
    """Open ``req`` (its id set) in the log as this ingress's, routed to a replica, with what
    an adopter runs it from (called on a worker thread: encoding a long prompt takes
    milliseconds)."""
    dlog.open(req.request_id or "", prompt_tokens=len(req.prompt_token_ids), detached=detached,
              ingress=True, request=stored(req), model=model)


def restored(blob: bytes) -> GenerationRequest:
    """The request as stored by :func:`stored`, its deadline (relative to arrival, G3) cut by
    the time since (past it, the least the engine takes: it then ends ``deadline_exceeded``).
    Raises :class:`~coda.durable.request_codec.StoredRequestError` for anything else."""
    accepted, req = decode_stored(blob)
    if req.deadline_s is not None:
        req = replace(req, deadline_s=max(req.deadline_s - (time.time() - accepted), 1e-3))
    return req


class Adopter:
    """``engine``'s :attr:`~coda.durable.redis_log.RedisStreamLog.adopter`."""

    def __init__(self, engine: RemoteEngine) -> None:
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def __call__(self, request_id: str, meta: dict[bytes, bytes]) -> bool:
        """Adopt the orphan ``request_id`` (its meta read as ``meta``) if it is this front
        end's model and the fenced takeover wins; True if it did (then it is submitted)."""
        dlog = self.engine.log
        # NOTE: compared as bytes: a model name planted as invalid UTF-8 raised here, out of
        # the reaper, and stopped the lease heartbeat with it
        if dlog is None or meta.get(b"model", b"") != self.engine.model_name.encode():
            return False
        try:
            req = restored(meta[b"req"])
        except StoredRequestError as exc:  # NOTE: refused, never run: left to the grace's end
            log.warning("adoptable request not readable here; refused: %s", exc,
                        extra={"request_id": request_id})
            return False
        if not dlog.adopt(request_id, meta):
            return False
        log.warning("adopted a detached request whose ingress is gone",
                    extra={"request_id": request_id,
                           "ingress": meta.get(b"owner", b"").decode(errors="replace")})
        asyncio.run_coroutine_threadsafe(self._submit(req), self._running_loop())
        return True

    async def _submit(self, req: GenerationRequest) -> None:
        """Submit it and read this front end's copy to its end (acknowledging it, P6: nobody
        else reads it here; its client reads the log)."""
        try:
            handle = self.engine.submit_adopted(req)
            async for _ in follow(handle.stream):
                pass
        except Exception:  # NOTE: logged, not lost on a future nobody awaits
            log.exception("adopted request failed here", extra={"request_id": req.request_id})

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="coda-adopted",
                                 daemon=True).start()
                self._loop = loop
            return self._loop
