"""The durable stream log as an engine wrapper (issue 22 step 3; issue 12 items 2, 3; SPEC P1–P4,
L2, C1).

:class:`DurableEngine` ``(inner, log)`` implements :class:`~coda.engine.protocol.Engine` over
another engine: every handle it returns reads the request's **durable** copy — the events
Redis acknowledged, so the first frame a client gets is durable (seed 004) — and a request
this process does not hold (another ingress submitted it, or this one restarted) is reopened
from the log. The server holds it as it holds any engine; nothing above it learns that Redis
exists. It is chosen once, when the app is built (``coda serve --redis-url``).

Two kinds of inner engine:

- an in-process engine (:class:`~coda.engine.async_engine.AsyncEngine`): this process owns
  each request in the log and copies the engine's stream into it (:class:`LogMirror`);
- an engine whose producers write the log themselves (:class:`LogWriting`, the Ray replicas of
  :class:`~coda.scaleout.remote.RemoteEngine` built with the same log): its streams already
  hold only durable events, so its handles are passed through.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol, runtime_checkable

from coda.durable.mirror import LogFollower, LogMirror
from coda.durable.redis_log import RedisStreamLog
from coda.engine.protocol import Engine, EngineHandle, ModelInfo
from coda.engine.types import EngineStats, GenerationRequest
from coda.finish import CancelCause
from coda.reader import StreamReading, follow
from coda.stream import RequestStream, StreamEvent

log = logging.getLogger("coda.durable")


@runtime_checkable
class LogWriting(Protocol):
    """An engine whose producers write each request's log themselves (built with ``log``)."""

    log: RedisStreamLog | None

    def detach(self, request_id: str) -> None: ...

    def cancel_anywhere(self, request_id: str, cause: CancelCause = CancelCause.CLIENT
                        ) -> bool: ...


class DurableHandle(StreamReading):
    """An :class:`~coda.engine.protocol.EngineHandle` whose ``stream`` is the durable copy:
    events reach it once the log holds them. ``cancel`` goes to whoever runs the request."""

    def __init__(self, request_id: str, stream: RequestStream, prompt_tokens: int,
                 cancel: Callable[[CancelCause], bool]) -> None:
        self.request_id = request_id
        self.stream = stream
        self.prompt_tokens = prompt_tokens
        self._cancel = cancel

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        if self.stream.closed:
            return False
        return self._cancel(cause)


class DurableEngine:
    """``inner`` behind the durable stream log ``log`` (this server's lease). ``manage_inner``:
    :meth:`start` / :meth:`shutdown` start and stop ``inner`` too (else it is shared and only
    this wrapper's own requests are ended at shutdown)."""

    def __init__(self, inner: Engine, durable: RedisStreamLog, *, manage_inner: bool = True,
                 capacity: int = 4096) -> None:
        self.inner = inner
        self.log = durable
        self.manage_inner = manage_inner
        self.writes_itself = isinstance(inner, LogWriting) and inner.log is durable
        self.model_name = inner.model_name
        self.model_aliases = inner.model_aliases
        self.context_length = inner.context_length
        self.config = inner.config
        self.tokenizer = inner.tokenizer
        self.chat = inner.chat
        self.identity = inner.identity
        self.trace = getattr(inner, "trace", None)  # NOTE: the playground's recent traces
        self.mirror: LogMirror | None = None
        self._held: OrderedDict[str, DurableHandle] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Take this server's lease (reaping orphans), start the mirror, then ``inner``."""
        if self._started:
            return
        self.log.start()
        # NOTE: an engine that posts its step ends (AsyncEngine) gets one flush per step
        steps = self.inner if getattr(self.inner, "stepping", None) is not None else None
        self.mirror = LogMirror(self.log, steps=steps)
        self._started = True
        if self.manage_inner:
            self.inner.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every request (``inner``'s, or this wrapper's own when ``inner`` is shared),
        write the rest of the log, then drop the lease. Idempotent."""
        if self.manage_inner:
            self.inner.shutdown(timeout)
        else:
            for h in self._live():
                h.cancel(CancelCause.SHUTDOWN)
        if not self._started:
            return
        self._started = False
        if self.mirror is not None:
            self.mirror.flush()
        self.log.stop(release=True)

    def _live(self) -> list[DurableHandle]:
        with self._lock:
            return [h for h in self._held.values() if not h.stream.closed]

    # -- requests --------------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> DurableHandle:
        inner = self.inner.submit(req)
        if self.writes_itself:
            # NOTE: replicas claim and write this request's log (coda.scaleout.producer)
            stream = inner.stream
        else:
            assert self.mirror is not None, "DurableEngine.start() first"

            def fenced(h: EngineHandle = inner) -> None:
                h.cancel(CancelCause.SHUTDOWN)

            stream = self.mirror.watch(inner.stream, record_id="",
                                       prompt_tokens=inner.prompt_tokens, on_fenced=fenced)
        handle = DurableHandle(inner.request_id, stream, inner.prompt_tokens, inner.cancel)
        self._hold(handle)
        return handle

    def _hold(self, handle: DurableHandle) -> None:
        with self._lock:
            self._held[handle.request_id] = handle
            while len(self._held) > self._capacity:
                victim = next((k for k, h in self._held.items() if h.stream.closed),
                              next(iter(self._held)))
                self._held.pop(victim)

    def reopen(self, request_id: str) -> DurableHandle:
        """The handle of ``request_id``: the one held here, else one rebuilt from the log
        (replay, then live from Redis); its cancel reaches the request where this process's
        engine can (replicas: whichever runs it), else answers False."""
        with self._lock:
            held = self._held.get(request_id)
        if held is not None:
            return held
        follower = LogFollower(self.log, request_id)
        # NOTE: billed by the owner; the terminal carries the prompt tokens
        return DurableHandle(request_id, follower.stream, 0,
                             lambda cause: self._cancel_elsewhere(request_id, cause))

    def attach(self, request_id: str, after_seq: int = -1) -> AsyncIterator[StreamEvent]:
        """Events of ``request_id`` after ``after_seq`` from its durable copy (any ingress);
        KeyError if the log does not know it (expired or never written)."""
        with self._lock:
            held = self._held.get(request_id)
        if held is None and not self.log.exists(request_id):
            raise KeyError(request_id)
        return follow(self.reopen(request_id).stream, after_seq)

    def cancel(self, request_id: str, cause: CancelCause = CancelCause.CLIENT) -> bool:
        with self._lock:
            held = self._held.get(request_id)
        if held is not None:
            return held.cancel(cause)
        return self._cancel_elsewhere(request_id, cause)

    def _cancel_elsewhere(self, request_id: str, cause: CancelCause) -> bool:
        if isinstance(self.inner, LogWriting) and self.writes_itself:
            return self.inner.cancel_anywhere(request_id, cause)
        return False  # NOTE: the owning server's request; it is not reachable from here

    def detach(self, request_id: str) -> None:
        """P4 ``continue`` / background: the request runs on without a client, also if this
        ingress dies (a replica then keeps writing its log instead of cancelling it)."""
        if isinstance(self.inner, LogWriting) and self.writes_itself:
            self.inner.detach(request_id)
        else:
            self.log.detach(request_id)

    def link_record(self, record_id: str, descriptor: dict[str, Any],
                    request_ids: list[str]) -> None:
        """Store an API record's descriptor and link its requests to it (its retention then
        follows their terminals, :meth:`RedisStreamLog.put_record`)."""
        self.log.put_record(record_id, descriptor, request_ids)

    def stats(self) -> EngineStats:
        return self.inner.stats()

    def num_queued(self, incoming: int = 0) -> int:
        return self.inner.num_queued(incoming)

    def model_info(self) -> ModelInfo:
        return self.inner.model_info()

    async def embed(self, token_ids: list[int]) -> list[float]:
        return await self.inner.embed(token_ids)  # NOTE: nothing of it is a stream to log
