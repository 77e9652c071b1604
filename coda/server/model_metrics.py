"""``/metrics`` of a several-model server (issue 23 item 1; SPEC O1): loads, unloads and the
memory each loaded model takes, beside the request metrics of :mod:`coda.server.metrics`."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

_LOAD_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ModelMetrics:
    """Created unregistered; :meth:`register` adds them to the app's registry."""

    def __init__(self, names: list[str], memory_budget: int | None) -> None:
        self.loads = Counter("coda:model_loads", "Model loads started, by outcome "
                             "(started, ok, failed).", ["model", "outcome"], registry=None)
        self.unloads = Counter("coda:model_unloads", "Models unloaded, by reason (lru, "
                               "worker_exit, load_failed, shutdown).", ["model", "reason"],
                               registry=None)
        self.waits = Counter("coda:model_load_waits", "Requests that waited for their model "
                             "to load.", ["model"], registry=None)
        self.loaded_gauge = Gauge("coda:model_loaded", "1 while the model is loaded, 0.5 while "
                                  "it loads, 0 unloaded.", ["model"], registry=None)
        self.memory = Gauge("coda:model_memory_bytes", "Weights + KV cache of the model "
                            "(0 when unloaded).", ["model"], registry=None)
        self.budget = Gauge("coda:memory_budget_bytes", "--memory-budget (0: none).",
                            registry=None)
        self.load_seconds = Histogram("coda:model_load_seconds", "Worker start to model "
                                      "loaded.", ["model"], buckets=_LOAD_BUCKETS, registry=None)
        self.budget.set(memory_budget or 0)
        for n in names:
            self.loaded_gauge.labels(model=n).set(0)
            self.memory.labels(model=n).set(0)
            for outcome in ("started", "ok", "failed"):
                self.loads.labels(model=n, outcome=outcome)

    def register(self, registry: Any) -> None:
        for c in (self.loads, self.unloads, self.waits, self.loaded_gauge, self.memory,
                  self.budget, self.load_seconds):
            registry.register(c)

    def load_started(self, slot: Any) -> None:
        self.loads.labels(model=slot.name, outcome="started").inc()
        self.loaded_gauge.labels(model=slot.name).set(0.5)
        self.memory.labels(model=slot.name).set(slot.footprint())

    def loaded(self, slot: Any, worker: Any) -> None:
        self.loads.labels(model=slot.name, outcome="ok").inc()
        self.loaded_gauge.labels(model=slot.name).set(1)
        self.memory.labels(model=slot.name).set(slot.footprint())
        if worker.load_s is not None:
            self.load_seconds.labels(model=slot.name).observe(worker.load_s)

    def load_failed(self, slot: Any) -> None:
        self.loads.labels(model=slot.name, outcome="failed").inc()

    def unloaded(self, slot: Any, why: str) -> None:
        self.unloads.labels(model=slot.name, reason=why).inc()
        self.loaded_gauge.labels(model=slot.name).set(0)
        self.memory.labels(model=slot.name).set(0)

    def refresh(self, slots: list[Any]) -> None:
        for s in slots:
            if s.worker is not None and s.worker.state == "ready":
                self.memory.labels(model=s.name).set(s.footprint())
