"""Several models behind one :class:`~coda.engine.protocol.Engine` (issue 23 item 1; SPEC P1–P3,
P6, C1, L2, L5, G3, O1).

The server holds a :class:`ModelRouter` as its engine; the routes stay unaware of it. The one
seam is ``ServerState.check_model`` (every route calls it first with the request's ``model``):
it calls :meth:`ModelRouter.select_model`, which records the model for the rest of that HTTP
request in a context variable (copied into the worker threads that render and tokenize, and
into tasks the route starts). The Engine attributes the routes read — ``tokenizer``, ``chat``,
``context_length``, ``model_name`` — and ``submit`` then answer for that model.

Each model runs in its own worker process (:mod:`coda.engine.process_engine`), started on first
use. A request for a model that is not loaded gets its handle at once and waits, with its
deadline (G3: ``deadline_exceeded`` if it passes first; a cancel ends it ``cancelled``), for
the load; then it goes to the worker with what is left of its deadline. A failed load, a
crash or an OOM kill ends only that model's requests, each with one FAILED ``model_error``
terminal naming the model and what happened; the next request loads the model again.

``--memory-budget``: weights + KV of the loaded models stay under it; to load a model the
least recently used idle (nothing in flight) unpinned models are unloaded first. A model that
alone exceeds the budget is refused (``model_error``), never loaded; one that fits only once
busy models go idle waits (with its deadline). Loads and unloads are counted in ``/metrics``
(``coda:model_loads``, ``coda:model_unloads``, ``coda:model_loaded``,
``coda:model_memory_bytes``) and written to the trace (``model.load`` / ``model.loaded`` /
``model.unload`` rows under the id ``model:<name>``; a request that waited has a
``model.wait`` row). A routed request's handle and its wait for the load are
:mod:`coda.server.model_dispatch`, the loads :mod:`coda.server.model_loads`, the merged trace
:mod:`coda.server.model_trace`.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import tokenizers

from coda.engine.process_copy import WorkerCopy
from coda.engine.protocol import ModelInfo
from coda.engine.types import EngineConfig, EngineStats, GenerationRequest
from coda.finish import CancelCause, Terminal
from coda.models.identity import ModelIdentity
from coda.models.source import model_key
from coda.models.tokenizer_bundle import TokenizerBundle
from coda.reader import follow, when_closed
from coda.server import model_dispatch
from coda.server.logs import configure_logging
from coda.server.model_dispatch import RoutedHandle
from coda.server.model_loads import ModelLoads
from coda.server.model_metrics import ModelMetrics
from coda.server.model_slot import ModelSlot
from coda.server.model_trace import RouterTrace
from coda.stream import StreamEvent
from coda.trace import JsonlTraceSink, TraceSink

log = logging.getLogger("coda.server")

_selected: contextvars.ContextVar[ModelSlot | None] = contextvars.ContextVar(
    "coda_selected_model", default=None)


class ModelRouter:
    """The :class:`~coda.engine.protocol.Engine` of a several-model server (module docstring).
    ``slots`` in serving order; the first answers when no model was selected (``/health``)."""

    def __init__(self, slots: Sequence[ModelSlot], config: EngineConfig, *,
                 memory_budget: int | None = None, log_level: str = "info") -> None:
        if not slots:
            raise ValueError("a model router needs at least one model")
        self.slots = list(slots)
        self.config = config
        self.memory_budget = memory_budget
        self._by_key: dict[str, ModelSlot] = {}
        for s in self.slots:  # NOTE: a served name wins over another model's alias
            self._by_key.setdefault(model_key(s.name), s)
        for s in self.slots:
            for a in s.aliases:
                self._by_key.setdefault(a, s)
        self.model_aliases: frozenset[str] = frozenset(self._by_key)
        self.metrics = ModelMetrics([s.name for s in self.slots], memory_budget)
        inner: TraceSink | None = (JsonlTraceSink(config.trace_path) if config.trace_path
                                   else None)
        self.trace = RouterTrace(self, max(config.recent_traces, 1), inner)
        self._handles: OrderedDict[str, RoutedHandle] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.stopping = False
        self.num_requests_total = 0
        # NOTE: picklable; the workers' log lines then look like the server's (O1)
        self.loads = ModelLoads(self.slots, memory_budget, self.metrics, self.trace,
                                functools.partial(configure_logging, log_level))

    # -- the selected model --------------------------------------------------------------
    def select_model(self, name: str) -> bool:
        """Route the rest of this HTTP request to ``name`` (False: no such model)."""
        slot = self._by_key.get(model_key(name))
        if slot is None:
            return False
        _selected.set(slot)
        return True

    def served_names(self) -> list[str]:
        return [s.name for s in self.slots]

    def _slot(self) -> ModelSlot:
        return _selected.get() or self.slots[0]

    @property
    def model_name(self) -> str:
        return self._slot().name

    @property
    def context_length(self) -> int:
        return self._slot().context_length

    @property
    def tokenizer(self) -> tokenizers.Tokenizer:
        return self._slot().tokenizer

    @property
    def chat(self) -> TokenizerBundle:
        return self._slot().chat

    @property
    def identity(self) -> ModelIdentity | None:
        return self._slot().identity

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._slot().chat.eos_token_ids

    def model_info(self) -> ModelInfo:
        s = self._slot()
        if s.info is None:  # NOTE: not loaded yet: what the slot knows before
            return ModelInfo(s.name, s.context_length, s.chat.eos_token_ids)
        return replace(s.info, name=s.name, context_length=s.context_length,
                                   eos_token_ids=s.chat.eos_token_ids)

    def model_card(self) -> dict[str, Any]:
        return self._card(self._slot())

    def model_cards(self) -> list[dict[str, Any]]:
        return [self._card(s) for s in self.slots]

    def _card(self, s: ModelSlot) -> dict[str, Any]:
        created = s.info.modified if s.info is not None else 0
        card: dict[str, Any] = {"id": s.name, "object": "model", "created": created,
                                "owned_by": "coda", "max_model_len": s.context_length}
        if s.identity is not None:
            card["coda"] = s.identity.to_dict()
        card["coda_model"] = {"status": s.status, "pinned": s.pinned,
                              "memory_bytes": s.footprint(), "loads": s.loads,
                              "pid": s.worker.pid if s.worker is not None else None}
        return card

    # -- Engine protocol -----------------------------------------------------------------
    def start(self) -> None:
        """Pinned models load now (they are never unloaded)."""
        for s in self.slots:
            if s.pinned:
                with self.loads.lock:
                    self.loads.try_load(s)

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every request (cancelled, cause shutdown: the workers end theirs and send the
        terminals), then stop every worker. Called off the event loop."""
        self.stopping = True
        live = [h for h in list(self._handles.values()) if not h.stream.closed]
        for h in live:
            h.cancel(CancelCause.SHUTDOWN)
        deadline = time.monotonic() + timeout
        while any(not h.stream.closed for h in live) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.loads.stop_all(deadline - time.monotonic())

    def submit(self, req: GenerationRequest) -> RoutedHandle:
        """A handle at once; the request goes to its model's worker once that is loaded."""
        if self.stopping:
            from coda.errors import EngineShutdownError

            raise EngineShutdownError("the engine is shutting down")
        slot = self._slot()
        rid = req.request_id or f"req-{uuid.uuid4().hex[:16]}"
        handle = RoutedHandle(rid, WorkerCopy(rid, lambda r, seq: self._ack(r, seq)),
                              len(req.prompt_token_ids), slot, time.monotonic())
        w = slot.worker
        if w is not None and w.state == "ready":
            # NOTE: loaded: the worker's engine validates now, so bad input is refused here
            # (the server's 400), as in process; the round trip blocks this call briefly
            handle.worker = w
            w.submit(replace(req, request_id=rid), handle.stream, validate=True)
            self._register(handle)
            self.num_requests_total += 1
            return handle
        self._register(handle)
        self.num_requests_total += 1
        task = asyncio.get_running_loop().create_task(
            model_dispatch.dispatch(self, slot, handle, replace(req, request_id=rid)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return handle

    def attach(self, request_id: str, after_seq: int = -1) -> AsyncIterator[StreamEvent]:
        handle = self._handles.get(request_id)
        if handle is None:
            raise KeyError(request_id)
        return follow(handle.stream, after_seq)

    def cancel(self, request_id: str, cause: CancelCause = CancelCause.CLIENT) -> bool:
        handle = self._handles.get(request_id)
        return handle.cancel(cause) if handle is not None else False

    def num_queued(self, incoming: int = 0) -> int:
        """Cheap, from the server's side: per model, its requests not ended (``incoming``
        more on the selected one) past its ``max_num_seqs`` batch slots: waiting minus the
        slots free is open minus the slots, whatever has started (a model not loaded yet
        starts that many at once when it is)."""
        open_per: dict[str, int] = {s.name: 0 for s in self.slots}
        for h in list(self._handles.values()):
            if not h.stream.closed:
                open_per[h.slot.name] = open_per.get(h.slot.name, 0) + 1
        open_per[self._slot().name] += incoming
        return sum(max(0, n - self.config.max_num_seqs) for n in open_per.values())

    def stats(self) -> EngineStats:
        """Summed over the loaded models (blocking: one call to each worker)."""
        parts: list[EngineStats] = []
        for s in self.slots:
            w = s.worker
            if w is not None and w.state == "ready":
                try:
                    parts.append(w.call("stats"))
                except TimeoutError:
                    continue
        self.metrics.refresh(self.slots)
        waiting_here = sum(1 for h in list(self._handles.values())
                           if not h.stream.closed and h.worker is None)
        return EngineStats(
            num_running=sum(p.num_running for p in parts),
            num_waiting=sum(p.num_waiting for p in parts) + waiting_here,
            kv_cache_usage=max((p.kv_cache_usage for p in parts), default=0.0),
            num_blocks=sum(p.num_blocks for p in parts),
            num_free_blocks=sum(p.num_free_blocks for p in parts),
            num_requests_total=self.num_requests_total,
            num_preemptions_total=sum(p.num_preemptions_total for p in parts),
            embed_chunks_total=sum(p.embed_chunks_total for p in parts),
            embeds_cancelled_total=sum(p.embeds_cancelled_total for p in parts))

    def register_metrics(self, registry: Any) -> None:
        """Add the load/unload metrics to the server's ``/metrics`` registry."""
        self.metrics.register(registry)

    # -- requests ------------------------------------------------------------------------
    def _register(self, h: RoutedHandle) -> None:
        slot = h.slot
        slot.live.add(h.request_id)
        slot.last_used = time.monotonic()

        def on_end(_terminal: Terminal) -> None:
            slot.live.discard(h.request_id)
            slot.last_used = time.monotonic()

        when_closed(h.stream, on_end)
        self._handles[h.request_id] = h
        while len(self._handles) > 4096:
            victim = next((k for k, v in self._handles.items() if v.stream.closed), None)
            if victim is None:
                break
            del self._handles[victim]

    def _ack(self, request_id: str, seq: int) -> None:
        h = self._handles.get(request_id)
        if h is not None and h.worker is not None:
            h.worker.ack(request_id, seq)

    async def embed(self, token_ids: list[int]) -> list[float]:
        """On the selected model's worker, loaded first as a request's would be (a model that
        cannot load: EngineNotStartedError, the server's 503)."""
        return await model_dispatch.embed(self, self._slot(), token_ids)


def build_router(specs: Sequence[Any], config: EngineConfig, *,
                 memory_budget: int | None = None, log_level: str = "info") -> ModelRouter:
    """Describe every model of ``specs`` (:class:`~coda.server.model_specs.ModelSpec`; no
    weights are read) and route between them. Each model's KV cache follows the usual rule
    (``--kv-cache-bytes``, else a fraction, at most ``max_num_seqs`` full contexts) within its
    share of ``memory_budget`` (the budget split evenly, less its weights). Raises
    ModelLoadError / ValueError for a model that cannot be resolved, or two served under one
    name."""
    from coda.server.model_slot import describe

    slots = [describe(s, config) for s in specs]
    names = [model_key(s.name) for s in slots]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"two models would be served under one name: {', '.join(dup)} "
                         f"(give each a name: --model NAME=SPEC)")
    if memory_budget is not None and config.kv_cache_bytes is None:
        share = memory_budget // len(slots)
        for s in slots:
            s.kv_available = max(share - s.weight_bytes, 0)
    return ModelRouter(slots, config, memory_budget=memory_budget, log_level=log_level)
