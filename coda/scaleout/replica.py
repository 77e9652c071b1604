"""One engine replica: an :class:`~coda.engine.async_engine.AsyncEngine` in a Ray Serve replica
(issue 12 item 1, 3; SPEC P1–P4, C1).

The ingress submits with ``submit(req, feed_id, durable, route)`` and reads the events of all
its requests on this replica through one streaming ``feed(feed_id)`` call
(:mod:`coda.scaleout.feed`: batches, not one Ray item per event). ``generate`` streams one
request's events, one item each (kept for direct callers). The engine request is owned by the
engine thread, not by a call: when Ray Serve cancels a call because its caller went away, only
the forwarding stops — the request keeps running (P4 ``on_disconnect=continue``, background
responses) until the ingress cancels it by id.

With a :class:`~coda.scaleout.producer.DurableSpec` (``--redis-url``) the replica claims the
request in the log and writes it there itself, and forwards only what Redis acknowledged
(:mod:`coda.scaleout.producer`). The ingress's routing decision arrives with the call and is
the first row of the request's trace (``route.decided``, O2).

Fault injection (tests, ``scripts/fault_matrix.py``): :meth:`EngineReplica.inject` makes the
log refuse deltas (``fail_appends``: the mirror keeps retrying, nothing past the start becomes
durable) or stops forwarding after the start event (``stall_forwarding``: deltas become durable
but never reach the ingress).
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from coda.engine.async_engine import AsyncEngine
from coda.engine.protocol import ModelInfo
from coda.engine.types import EngineConfig, EngineStats, GenerationRequest
from coda.finish import CancelCause
from coda.reader import follow
from coda.scaleout.feed import Outbox
from coda.scaleout.producer import DurableSpec, ReplicaLog
from coda.scaleout.routing_trace import ROUTE_DECIDED
from coda.stream import EventType, RequestStream, StreamEvent
from coda.trace import TraceEvent

_EARLY_CANCELS = 4096  # NOTE: cancels kept for requests not (yet) submitted here


class EngineReplica:
    def __init__(self, model_dir: str | None, config: EngineConfig, torch_threads: int) -> None:
        import torch

        torch.set_num_threads(torch_threads)
        self.pid = os.getpid()
        if config.trace_path:
            config = replace(config, trace_path=replica_trace_path(config.trace_path, self.pid))
        self.engine = AsyncEngine.from_model_dir(model_dir, config)
        self.engine.start()
        self.server_id = f"replica-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._logs: dict[tuple[str, str], ReplicaLog] = {}
        self.faults: set[str] = set()
        self._outboxes: dict[str, Outbox] = {}
        # NOTE: C1: cancels that found no request here yet (see cancel), applied at its start
        self._early_cancels: OrderedDict[str, CancelCause] = OrderedDict()
        self._cancel_lock = threading.Lock()

    async def _start(self, req: GenerationRequest, durable: DurableSpec | None,
                     route: dict[str, Any] | None) -> tuple[RequestStream, Any]:
        """Submit ``req`` (claimed and mirrored by this replica with ``durable``); the stream
        to forward (durable events only, with a log) and what appends to it in steps (the
        engine, or with a log its mirror: :class:`~coda.scaleout.feed.Outbox`)."""
        if route is not None and req.request_id:
            self.engine.trace.record(TraceEvent(req.request_id, ROUTE_DECIDED, route))
        if durable is None:
            stream: RequestStream = self.engine.submit(req).stream
            self._apply_early_cancel(req.request_id)
            return stream, self.engine
        plog = await asyncio.to_thread(self._log, durable)
        copy = await asyncio.to_thread(plog.begin, self.engine, req, durable,
                                       asyncio.get_running_loop())
        self._apply_early_cancel(req.request_id)
        return copy, plog.mirror

    def _apply_early_cancel(self, request_id: str | None) -> None:
        """A cancel that arrived before this request was submitted here ends it now (C1)."""
        with self._cancel_lock:
            cause = self._early_cancels.pop(request_id or "", None)
        if cause is not None:
            self.engine.cancel(request_id or "", cause)

    def _outbox(self, feed_id: str) -> Outbox:
        box = self._outboxes.get(feed_id)
        if box is None:
            box = self._outboxes[feed_id] = Outbox(asyncio.get_running_loop())
        return box

    async def submit(self, req: GenerationRequest, feed_id: str,
                     durable: DurableSpec | None = None,
                     route: dict[str, Any] | None = None) -> None:
        """Start ``req`` as :meth:`generate` does; its events go to the ingress reading
        ``feed(feed_id)``."""
        stream, steps = await self._start(req, durable, route)
        self._outbox(feed_id).forward(stream, start_only="stall_forwarding" in self.faults,
                                      steps=steps)

    async def feed(self, feed_id: str) -> AsyncIterator[bytes]:
        """Batches of the events of every request submitted with ``feed_id`` (one call per
        ingress); when the caller goes away the outbox is dropped, the requests run on."""
        box = self._outbox(feed_id)
        try:
            async for blob in box.drain():
                yield blob
        finally:
            if self._outboxes.get(feed_id) is box:
                del self._outboxes[feed_id]

    async def generate(self, req: GenerationRequest, durable: DurableSpec | None = None,
                       route: dict[str, Any] | None = None) -> AsyncIterator[StreamEvent]:
        stream, _ = await self._start(req, durable, route)
        # NOTE: a cancelled generator (caller gone) leaves the engine request running
        async for ev in follow(stream):
            if "stall_forwarding" in self.faults and ev.type is not EventType.START:
                await asyncio.Event().wait()  # NOTE: fault injection: never forwarded
            yield ev

    def _log(self, spec: DurableSpec) -> ReplicaLog:
        key = (spec.url, spec.prefix)
        if key not in self._logs or self._logs[key].closed:
            self._logs[key] = ReplicaLog(spec, self.server_id, steps=self.engine)
            if "fail_appends" in self.faults:
                _fail_deltas(self._logs[key])
        return self._logs[key]

    def inject(self, fault: str) -> None:
        """Fault injection: ``fail_appends`` or ``stall_forwarding`` from now on."""
        self.faults.add(fault)
        if fault == "fail_appends":
            for plog in self._logs.values():
                _fail_deltas(plog)

    def trace_rows(self, request_id: str) -> list[dict[str, Any]] | None:
        """The request's rows in this replica's in-memory trace (None if not kept)."""
        rows = getattr(self.engine.trace, "rows", None)
        found = rows(request_id) if rows is not None else None
        return None if found is None else [e.to_dict() for e in found[0]]

    def cancel(self, request_id: str, cause: CancelCause) -> bool:
        """Cancel ``request_id`` here (C1). The ingress's submit and cancel are two Serve
        calls with no order between them, so a cancel may overtake the submit: one that finds
        no request is kept (bounded) and applied when the request starts here. Checked and
        kept under one lock, after the submit, so none falls between (the start checks after
        its submit)."""
        with self._cancel_lock:
            if self.engine.cancel(request_id, cause):
                return True
            self._early_cancels[request_id] = cause
            while len(self._early_cancels) > _EARLY_CANCELS:
                self._early_cancels.popitem(last=False)
        return False

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    async def embed(self, token_ids: list[int]) -> list[float]:
        return await self.engine.embed(token_ids)

    def feed_stats(self) -> dict[str, int]:
        """Engine steps taken and feed messages sent (by the live outboxes), for benchmarks."""
        return {"steps": self.engine.steps,
                "messages": sum(b.messages for b in self._outboxes.values())}

    def whoami(self) -> dict[str, Any]:
        return {"pid": self.pid, "server_id": self.server_id,
                "orphans_cancelled": sum(p.cancelled_orphans for p in self._logs.values())}

    def serving_attrs(self) -> dict[str, Any]:
        """What the server reads off its engine besides calls (the tokenizer for prompts and
        logprobs, chat template data, the model's identity), for the ingress to hold locally:
        every attribute of :data:`SERVED_ATTRS` this engine has, pickled by Ray."""
        attrs = {k: getattr(self.engine, k) for k in SERVED_ATTRS if hasattr(self.engine, k)}
        if hasattr(self.engine, "model_info"):  # NOTE: what /api/show describes
            attrs["served_model_info"] = self.engine.model_info()
        return attrs


def replica_trace_path(path: str, pid: int) -> str:
    """``coda serve --replicas N --trace PATH``: each replica process writes its own JSONL,
    ``PATH`` with ``.replica-<pid>`` before the suffix, so ``coda trace check`` reads one
    process's rows per file — a replica SIGKILLed mid-request leaves that request unfinished in
    its file only, and a request resubmitted to another replica is whole in that one's."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.replica-{pid}{p.suffix}"))


# NOTE: the Engine protocol's data attributes; an engine version lacking one just omits it
SERVED_ATTRS = ("model_name", "model_aliases", "context_length", "eos_token_ids", "tokenizer",
                "tokenizer_config", "generation_config", "chat", "identity")


def _fail_deltas(plog: ReplicaLog) -> None:
    """Fault injection: every append holding a delta raises (as a lost Redis would)."""
    import redis

    inner = plog.log.append_runs

    def failing(batch: list[Any], first_key: int | None = None) -> list[Any]:
        if any(ev.seq >= 1 for evs, _ in batch for ev in evs):
            raise redis.ConnectionError("injected: append refused")
        return inner(batch, first_key)

    plog.log.append_runs = failing  # type: ignore[method-assign]
