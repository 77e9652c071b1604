"""Loading and unloading the models of a several-model server under one memory budget
(issue 23 item 1; SPEC O1). See :mod:`coda.server.model_router` for the whole picture.

Weights + KV of the loaded models stay under ``memory_budget``: to load a model the least
recently used idle (nothing in flight) unpinned models are unloaded first; a model that alone
exceeds the budget is refused; one that fits only once busy models go idle waits. Every load
and unload is counted (:class:`~coda.server.model_metrics.ModelMetrics`), logged, and written
to the trace under the id ``model:<name>``. Decisions are taken under :attr:`ModelLoads.lock`.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from coda.engine.process_engine import WorkerProcess
from coda.server.model_metrics import ModelMetrics
from coda.server.model_slot import ModelSlot
from coda.trace import TraceEvent, TraceSink

log = logging.getLogger("coda.server")


class ModelLoads:
    def __init__(self, slots: list[ModelSlot], memory_budget: int | None,
                 metrics: ModelMetrics, trace: TraceSink, log_setup: Any) -> None:
        self.slots, self.memory_budget = slots, memory_budget
        self.metrics, self.trace, self.log_setup = metrics, trace, log_setup
        self.lock = threading.Lock()

    def stop_all(self, timeout: float) -> None:
        """Unload every model (reason ``shutdown``), waiting up to ``timeout`` for each."""
        stops = []
        for s in self.slots:
            w, s.worker = s.worker, None
            if w is not None:
                self.unloaded(s, w, "shutdown")
                t = threading.Thread(target=w.stop, args=(max(1.0, timeout),))
                t.start()
                stops.append(t)
        for t in stops:
            t.join()

    def try_load(self, slot: ModelSlot) -> str | None:
        """Start loading ``slot`` if it fits (unloading LRU idle models to make room);
        a message when it can never fit; None otherwise (started, or still waiting)."""
        budget = self.memory_budget
        need = slot.footprint()
        if budget is not None:
            if need > budget:
                return (f"model '{slot.name}' needs about {need} bytes (weights + KV cache), "
                        f"more than --memory-budget {budget}")
            while need + self._used(slot) > budget:
                victims = sorted((s for s in self.slots if s is not slot and s.worker is not None
                                  and not s.pinned and s.idle()), key=lambda s: s.last_used)
                if not victims:
                    return None  # NOTE: waits until a model goes idle (or its deadline)
                self._unload(victims[0], "lru")
        slot.loads += 1
        slot.worker = WorkerProcess(slot.name, _model_arg(slot), slot.config,
                                    kv_available=slot.kv_available,
                                    log_setup=self.log_setup,
                                    on_exit=functools.partial(self.exited, slot))
        self.metrics.load_started(slot)
        self.trace.record(TraceEvent(f"model:{slot.name}", "model.load", {
            "model": slot.name, "estimated_bytes": need, "budget": budget,
            "used_bytes": self._used(slot)}))
        log.info("model loading", extra={"model": slot.name, "estimated_bytes": need})
        slot.worker.start()
        threading.Thread(target=self._watch_load, args=(slot, slot.worker), daemon=True).start()
        return None

    def _used(self, but: ModelSlot) -> int:
        return sum(s.footprint() for s in self.slots if s is not but and s.worker is not None)

    def _watch_load(self, slot: ModelSlot, w: WorkerProcess) -> None:
        w.settled.wait()
        if w.state != "ready":
            return
        slot.identity = w.info.get("identity")
        slot.info = w.info.get("model_info")
        slot.context_length = min(slot.context_length, int(w.info.get("context_length",
                                                                       slot.context_length)))
        self.metrics.loaded(slot, w)
        self.trace.record(TraceEvent(f"model:{slot.name}", "model.loaded", {
            "model": slot.name, "pid": w.pid, "load_s": w.load_s, "memory_bytes": slot.footprint(),
            "kv_cache_bytes": w.info.get("kv_cache_bytes")}))
        log.info("model loaded", extra={**w.info.get("summary", {}), "path": str(
            slot.source.path), "model": slot.name, "load_s": w.load_s})

    def _unload(self, slot: ModelSlot, why: str) -> None:
        w, slot.worker = slot.worker, None
        if w is None:
            return
        self.unloaded(slot, w, why)
        threading.Thread(target=w.stop, daemon=True).start()

    def unload_idle(self, name: str) -> str:
        """Unload ``name`` now (reason ``keep_alive``: Ollama's ``keep_alive: 0``) if it is
        loaded, idle and not pinned: ``unloaded``; else why not: ``not_loaded`` | ``pinned`` |
        ``busy`` (requests of it in flight)."""
        with self.lock:
            slot = next((s for s in self.slots if s.name == name), None)
            if slot is None or slot.worker is None:
                return "not_loaded"
            if slot.pinned:
                return "pinned"
            if not slot.idle():
                return "busy"
            self._unload(slot, "keep_alive")
            return "unloaded"

    def unloaded(self, slot: ModelSlot, w: WorkerProcess, why: str) -> None:
        self.metrics.unloaded(slot, why)
        self.trace.record(TraceEvent(f"model:{slot.name}", "model.unload", {
            "model": slot.name, "reason": why, "pid": w.pid, "error": w.error}))
        log.info("model unloaded", extra={"model": slot.name, "reason": why, "error": w.error})

    def exited(self, slot: ModelSlot, w: WorkerProcess) -> None:
        """The process is gone (or its load failed): from the worker's reader thread, or a
        request that saw it first (counted once either way)."""
        with self.lock:
            if slot.worker is not w:
                return  # NOTE: unloaded by us already (counted then)
            slot.worker = None
            why = "load_failed" if w.state == "failed" else "worker_exit"
            if w.state == "failed":
                self.metrics.load_failed(slot)
            self.unloaded(slot, w, why)


def _model_arg(slot: ModelSlot) -> str | None:
    return None if slot.source.kind == "embedded" else str(slot.source.path)
