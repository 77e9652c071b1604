"""The typed seam between the server and an engine (issue 11 item 3; SPEC P1–P3, C1, L2).

The server holds an :class:`Engine` and nothing more specific: ``submit`` a
:class:`~coda.engine.types.GenerationRequest` and get an :class:`EngineHandle`; ``attach`` to a
request's log after a sequence number to resume it (P3); ``cancel`` by id (C1); read ``stats``
and ``model_info``. The in-process :class:`~coda.engine.async_engine.AsyncEngine` implements it;
a remote engine (another process, a Ray Serve replica) implements the same protocol.
:class:`RequestHandle` is the in-process engine's handle: the request's replayable stream
(read through :mod:`coda.reader`, like every other reader) and the one way to cancel it (P3,
P6, C1).

Every message that crosses the seam is plain data: ``GenerationRequest``, ``StreamEvent`` (with
its ``Terminal``, ``TokenInfo``, ``Usage``), ``EngineStats`` and :class:`ModelInfo`
are frozen dataclasses of ``str``/``int``/``float``/``bytes``, string enums and tuples of those.
They pickle as they are (what Ray sends, inside the Ray cluster's trust boundary); what the
shared Redis log stores is never a pickle: :mod:`coda.durable.codec` writes events as
MessagePack and :mod:`coda.durable.request_codec` an adopter's request as typed JSON. Nothing
on the seam holds a lock, a thread or a tensor.

:class:`StreamLog` is the event log behind resume, as an interface: the in-memory one of a
single process (:class:`InMemoryStreamLog`, the default) and the durable Redis Streams one
(:class:`coda.durable.redis_log.RedisStreamLog`, ``coda serve --redis-url``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import tokenizers

from coda.engine.types import EngineConfig, EngineStats, GenerationRequest
from coda.finish import CancelCause, Terminal
from coda.models.identity import ModelIdentity
from coda.models.tokenizer_bundle import TokenizerBundle
from coda.reader import StreamReading, follow, wait_terminal
from coda.stream import RequestStream, StreamEvent

if TYPE_CHECKING:
    from coda.request import RequestRun


@dataclass(frozen=True)
class ModelInfo:
    """What the server needs to know about the served model (plain data)."""

    name: str
    context_length: int
    eos_token_ids: frozenset[int]
    # NOTE: what Ollama's /api/show describes ("" / 0 where the engine does not know it)
    architecture: str = ""  # ModelConfig.arch: "llama", "qwen2", ...
    parameters: int = 0  # parameter count (ModelConfig.num_parameters)
    quantization: str = ""  # the stored tensor type: "Q4_1", "float32", ...
    modified: int = 0  # the checkpoint's last change, Unix seconds (ModelSource.modified)


@runtime_checkable
class EngineHandle(Protocol):
    """One submitted request: its replayable stream and the one way to cancel it (P3, C1)."""

    request_id: str
    stream: RequestStream
    prompt_tokens: int

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool: ...

    def events(self, after: int = -1) -> AsyncIterator[StreamEvent]: ...

    async def result(self) -> Terminal: ...


@runtime_checkable
class Engine(Protocol):
    """What the server depends on. ``tokenizer`` and ``chat`` (the chat template, its special
    tokens and the end-of-generation ids) are read by the server to render chat templates and
    encode prompts; ``config`` gives its defaults; ``identity`` is the model's content
    identity (P1), computed once at load."""

    model_name: str
    model_aliases: frozenset[str]  # names accepted as ``model``, by coda.models.source.model_key
    context_length: int
    config: EngineConfig
    tokenizer: tokenizers.Tokenizer
    chat: TokenizerBundle
    identity: ModelIdentity

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 30.0) -> None: ...

    def submit(self, req: GenerationRequest) -> EngineHandle: ...

    def attach(self, request_id: str, after_seq: int = -1) -> AsyncIterator[StreamEvent]:
        """Events of ``request_id`` after ``after_seq`` (replay, then live); KeyError if the
        engine no longer knows the request."""
        ...

    def cancel(self, request_id: str, cause: CancelCause = CancelCause.CLIENT) -> bool: ...

    def stats(self) -> EngineStats: ...

    def num_queued(self, incoming: int = 0) -> int:
        """How many of the accepted requests, with ``incoming`` new generation requests, would
        wait for a batch slot: those past the slots free (``max_num_seqs`` − running), not
        every request a step has yet to admit, so a burst that fits the free slots queues
        nothing. An embedding queued for the engine thread waits whatever the slots. Cheap,
        non-blocking, callable on the server's event loop (admission's bounded queue, 429,
        docs/api.md "Overload"); ``stats()`` may block (a remote engine)."""
        ...

    def model_info(self) -> ModelInfo: ...

    async def embed(self, token_ids: list[int]) -> list[float]:
        """The mean-pooled last hidden state of ``token_ids`` (after the final norm; not
        normalised): InvalidRequestError on an empty, too long or out-of-vocabulary input."""
        ...


@runtime_checkable
class ModelSelecting(Protocol):
    """An :class:`Engine` serving several models (``coda.server.model_router``): the server
    routes a call by its ``model`` name with :meth:`select_model` (False: not served) and
    names the served ones in the 404."""

    def select_model(self, name: str) -> bool: ...

    def served_names(self) -> list[str]: ...


class StreamLog(Protocol):
    """The per-request event log (P1–P3): appends are idempotent by ``(request_id, seq)``
    and a request's log accepts exactly one terminal, after which it accepts nothing."""

    def append(self, event: StreamEvent) -> bool:
        """Append ``event``; False when it is a duplicate or the log is already closed."""
        ...

    def read(self, request_id: str, after_seq: int = -1) -> list[StreamEvent]: ...

    def terminal(self, request_id: str) -> Terminal | None: ...


class InMemoryStreamLog:
    """The single-process log: the engine's own :class:`RequestStream` objects, by id, the
    ``capacity`` most recent kept (oldest finished evicted first). Appends go through the
    stream itself (the engine is the only producer), so :meth:`append` only checks."""

    def __init__(self, capacity: int = 4096) -> None:
        self._capacity = capacity
        self._streams: OrderedDict[str, RequestStream] = OrderedDict()
        self._lock = threading.Lock()

    def open_handle(self, run: RequestRun, wake_engine: Callable[[], None]) -> RequestHandle:
        """The caller's :class:`RequestHandle` on a queued ``run``, its stream registered first
        so that ``attach`` finds it (P3)."""
        self.register(run.stream)
        return RequestHandle(run, wake_engine)

    def register(self, stream: RequestStream) -> None:
        with self._lock:
            self._streams[stream.request_id] = stream
            while len(self._streams) > self._capacity:
                victim = next((k for k, s in self._streams.items() if s.closed),
                              next(iter(self._streams)))
                self._streams.pop(victim)

    def stream(self, request_id: str) -> RequestStream | None:
        with self._lock:
            return self._streams.get(request_id)

    def append(self, event: StreamEvent) -> bool:
        stream = self.stream(event.request_id)
        # NOTE: the engine already appended it; anything else is a duplicate by construction
        return stream is not None and stream.last_seq < event.seq and not stream.closed

    def read(self, request_id: str, after_seq: int = -1) -> list[StreamEvent]:
        stream = self.stream(request_id)
        return [] if stream is None else stream.events_after(after_seq)

    def terminal(self, request_id: str) -> Terminal | None:
        stream = self.stream(request_id)
        return None if stream is None else stream.terminal


class RequestHandle(StreamReading):
    """A submitted request: its stream (read through :class:`coda.reader.StreamReading`), and
    the one way to cancel it."""

    def __init__(self, run: RequestRun, wake_engine: Callable[[], None]) -> None:
        self._run = run
        self._wake = wake_engine
        self.request_id = run.request_id
        self.stream: RequestStream = run.stream
        self.prompt_tokens: int = run.prompt_tokens

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        """Request a cancel (C1 moment 1); the engine observes it at its next safe point."""
        ok = self._run.request_cancel(cause)
        self._wake()
        return ok

    def events(self, after: int = -1) -> AsyncGenerator[StreamEvent, None]:
        """The request's events after ``after``, replayed then followed live (P3), by the
        caller that owns the request: left before its terminal (``break``, ``aclose()``, the
        reading task cancelled, the iterator garbage-collected) the request is cancelled
        (cause ``client``: CANCELLED, ``cancelled``; C1, L7 its resources released once), as
        a client that goes away (P4, the Python API's declared policy). A reader that must
        not end it reads through :meth:`AsyncEngine.attach`, :meth:`wait` or :meth:`result`."""
        return _owned_events(self, after)

    def wait(self, timeout: float | None = None) -> Terminal:
        """Blocking wait for the terminal (for synchronous callers; no event loop needed)."""
        terminal = wait_terminal(self.stream, timeout)
        if terminal is None:
            raise TimeoutError(f"{self.request_id} not finished after {timeout}s")
        return terminal


async def _owned_events(handle: RequestHandle, after: int
                        ) -> AsyncGenerator[StreamEvent, None]:
    """:func:`coda.reader.follow` of ``handle``'s stream that cancels the request when the
    reader leaves before the terminal (:meth:`RequestHandle.events`). An abandoned async
    generator is closed by its event loop (asyncio's finalizer hook, or the loop's
    ``shutdown_asyncgens``), which runs this ``finally``."""
    events = follow(handle.stream, after)
    try:
        async for ev in events:
            yield ev
    finally:
        if handle.stream.terminal is None:  # NOTE: left before the end: the reader is gone
            handle.cancel(CancelCause.CLIENT)
        await events.aclose()
