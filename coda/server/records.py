"""One API call's record and where records are kept (issue 22; SPEC P3, P4).

A :class:`Record` is born planned by an adapter's parse (:func:`coda.server.params.plan_call`)
and submitted by the create handler (:func:`coda.server.common.create`), which fills its
engine handles; the :class:`ResponseStore` keeps it for replay, resume, ``GET`` and cancel by
id: in memory (:class:`RecordStore`), or in memory and the durable stream log
(:class:`coda.server.durable.RedisResponseStore`). Each protocol registers how its renderer is
rebuilt from a record (:func:`register_renderer`). Split off ``coda/server/state.py`` by
size: the per-app state holds a store, a record never holds the state.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from coda.engine.protocol import EngineHandle
from coda.engine.types import GenerationRequest
from coda.finish import CancelCause
from coda.server.render_spec import OpenAIRender, RecordKind, RenderSpec
from coda.server.sse import Renderer
from coda.stream import RequestStream

DisconnectPolicy = Literal["cancel", "continue"]


# NOTE: each protocol registers how its renderer is rebuilt from a record (its spec type)
RendererFactory = Callable[["Record", "list[int] | None"], Renderer]
_RENDERERS: dict[type, RendererFactory] = {}


def register_renderer(spec_type: type, factory: RendererFactory) -> None:
    """Called once per protocol at import (coda.server.common's adapters)."""
    _RENDERERS[spec_type] = factory


@dataclass
class Record:
    """One API call: born planned by the adapter's parse (:func:`coda.server.params.plan_call`:
    its engine ``requests``, the error ``rename``s, the typed spec its renderer is rebuilt
    from — coda.server.render_spec; the durable log stores it as plain data — and how it is
    delivered), then submitted by the create handler, which fills its n engine ``handles``.
    One holder of the call from parse to replay (issue 22: no frozen plan copied into a
    second record). ``keep``: it stays readable after it ended (False: forgotten at its end).
    A record rebuilt from the durable log has handles and no requests."""

    id: str
    kind: RecordKind
    handles: list[EngineHandle]
    created: int
    model: str
    spec: RenderSpec
    background: bool = False
    # NOTE: P3, P5: the first delivery's network send time per choice (network_send_s)
    send_s: dict[int, float] = field(default_factory=dict)
    # NOTE: where the store keeps it beyond this process (the durable log: another front end
    # or a restart renders the first delivery's value): (choice, measured) -> the kept value
    keep_send_s: Callable[[int, float], float] | None = field(default=None, repr=False)
    # NOTE: the plan, read once by the create handler; the requests (prompt ids) are let go
    # once submitted, so a stored record does not keep its prompts
    requests: tuple[GenerationRequest, ...] = field(default=(), repr=False)
    rename: Mapping[str, str] = field(default_factory=dict)
    # NOTE: each request's prompt index where the call has several prompts (errors name it)
    prompt_of: tuple[int, ...] = field(default=(), repr=False)
    stream: bool = False
    on_disconnect: DisconnectPolicy | None = None
    keep: bool = True

    def network_send_s(self, index: int, measured: float) -> float:
        """The recorded network send time of choice ``index`` (``coda.timings``, P5):
        ``measured`` becomes the record the first time any reader renders that choice's
        terminal; every later rendering (a replay, a second reader) reads the recorded value,
        so a replayed terminal is byte-identical to the live one (P3). Kept on the record
        itself (issue 22: no per-request object of its own); ``dict.setdefault`` with an int
        key is one atomic step, so two readers racing keep one value. With ``keep_send_s``
        (the durable log) the first value any front end recorded wins, here too."""
        value = round(measured, 6)
        if index not in self.send_s and self.keep_send_s is not None:
            value = self.keep_send_s(index, value)
        return self.send_s.setdefault(index, value)

    def make_renderer(self, after: list[int] | None) -> Renderer:
        """The protocol's renderer over this record's streams, resuming after ``after``."""
        return _RENDERERS[type(self.spec)](self, after)

    @property
    def streams(self) -> list[RequestStream]:
        return [h.stream for h in self.handles]

    @property
    def deletable(self) -> bool:
        """A client may delete it by id: a response, or a chat completion stored with
        ``store: true`` (coda.server.chat_store); other records only age out."""
        return self.kind == "response" or self.stored_chat

    @property
    def stored_chat(self) -> bool:
        """A chat completion created with ``store: true`` (coda.server.chat_store)."""
        return self.kind == "chat" and isinstance(self.spec, OpenAIRender) and self.spec.stored

    @property
    def done(self) -> bool:
        return all(h.stream.closed for h in self.handles)

    def cancel(self, cause: CancelCause) -> None:
        for h in self.handles:
            h.cancel(cause)


class ResponseStore(Protocol):
    """Where the server keeps its API records (replays, ``GET /v1/responses/{id}``, cancel by
    id): in memory (:class:`RecordStore`), or in memory and the durable stream log
    (:class:`coda.server.durable.RedisResponseStore`, ``--redis-url``). Chosen once, when the
    app is built (issue 22 step 3)."""

    def put(self, record: Record) -> None: ...

    def get(self, rid: str) -> Record | None: ...

    def remove(self, rid: str) -> None: ...

    def delete(self, rid: str) -> bool:
        """Forget ``rid`` for good (``DELETE /v1/responses/{id}``: with the durable log, on
        every front end and after a restart); False if it was not stored (already deleted)."""
        ...

    def records(self) -> list[Record]:
        """The records held in this process."""
        ...

    def stored_chats(self) -> list[Record]:
        """The ended stored chat completions, oldest first (``GET /v1/chat/completions``):
        this process's; with the durable log every front end's on it."""
        ...

    def detach(self, record: Record) -> None:
        """P4 ``continue``: ``record``'s requests run on without a client (the durable log
        records it, so they survive this ingress)."""
        ...

    def __len__(self) -> int: ...


class RecordStore:
    """The in-memory :class:`ResponseStore`: a bounded map id → :class:`Record` that evicts
    the oldest finished record first. A subclass rebuilds records it does not hold
    (:meth:`_load`), which are then kept, and may say a held one is gone (:meth:`_current`)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._items: OrderedDict[str, Record] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, record: Record) -> None:
        with self._lock:
            self._items[record.id] = record
            while len(self._items) > self._capacity:
                victim = next((k for k, r in self._items.items() if r.done), None)
                self._items.pop(victim if victim is not None else next(iter(self._items)))

    def get(self, rid: str) -> Record | None:
        with self._lock:
            record = self._items.get(rid)
        if record is not None and not self._current(record):
            self.remove(rid)  # NOTE: deleted elsewhere: this copy must not bring it back
            return None
        if record is None:
            record = self._load(rid)
            if record is not None:
                with self._lock:
                    record = self._items.setdefault(rid, record)
        return record

    def _load(self, rid: str) -> Record | None:
        return None  # NOTE: one process's memory: what it does not hold does not exist

    def _current(self, record: Record) -> bool:
        return True  # NOTE: one process's memory is the only copy: what it holds exists

    def detach(self, record: Record) -> None:
        return None  # NOTE: in one process a request lives as long as its engine anyway

    def remove(self, rid: str) -> None:
        with self._lock:
            self._items.pop(rid, None)

    def delete(self, rid: str) -> bool:
        with self._lock:
            # NOTE: one pop under the lock: of two racing deletes exactly one answers True
            return self._items.pop(rid, None) is not None

    def records(self) -> list[Record]:
        with self._lock:
            return list(self._items.values())

    def stored_chats(self) -> list[Record]:
        # NOTE: stable: records created in one second keep their order
        return sorted((r for r in self.records() if r.stored_chat and r.done),
                      key=lambda r: r.created)

    def __len__(self) -> int:
        return len(self._items)
