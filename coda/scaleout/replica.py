"""One engine replica: an :class:`~coda.engine.async_engine.AsyncEngine` in a Ray Serve replica
(issue 12 item 1, 3; SPEC P1–P4, C1).

The ingress submits with ``submit(req, feed_id)`` and reads the events of all its requests on
this replica through one streaming ``feed(feed_id)`` call (:mod:`coda.scaleout.feed`: batches,
not one Ray item per event). ``generate`` streams one request's events, one item each (kept
for direct callers). The engine request is owned by the engine thread, not by a call: when Ray
Serve cancels a call because its caller went away, only the forwarding stops — the request
keeps running (P4 ``on_disconnect=continue``, background responses) until the ingress cancels
it by id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from coda.engine.async_engine import AsyncEngine
from coda.engine.protocol import ModelInfo
from coda.engine.types import EngineConfig, EngineStats, GenerationRequest
from coda.finish import CancelCause
from coda.reader import follow
from coda.scaleout.feed import Outbox
from coda.stream import StreamEvent


class EngineReplica:
    def __init__(self, model_dir: str | None, config: EngineConfig, torch_threads: int) -> None:
        import os

        import torch

        torch.set_num_threads(torch_threads)
        self.pid = os.getpid()
        self.engine = AsyncEngine.from_model_dir(model_dir, config)
        self.engine.start()
        self._outboxes: dict[str, Outbox] = {}

    def _outbox(self, feed_id: str) -> Outbox:
        box = self._outboxes.get(feed_id)
        if box is None:
            box = self._outboxes[feed_id] = Outbox(asyncio.get_running_loop())
        return box

    async def submit(self, req: GenerationRequest, feed_id: str) -> None:
        """Queue ``req``; its events go to the ingress reading ``feed(feed_id)``."""
        handle = self.engine.submit(req)
        self._outbox(feed_id).forward(handle.stream)

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

    async def generate(self, req: GenerationRequest) -> AsyncIterator[StreamEvent]:
        handle = self.engine.submit(req)
        # NOTE: a cancelled generator (caller gone) leaves the engine request running
        async for ev in follow(handle.stream):
            yield ev

    def cancel(self, request_id: str, cause: CancelCause) -> bool:
        return self.engine.cancel(request_id, cause)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def model_info(self) -> ModelInfo:
        return self.engine.model_info()

    def whoami(self) -> dict[str, Any]:
        return {"pid": self.pid}

    def serving_attrs(self) -> dict[str, Any]:
        """What the server reads off its engine besides calls (the tokenizer for prompts and
        logprobs, chat template data, the model's identity), for the ingress to hold locally:
        every attribute of :data:`SERVED_ATTRS` this engine has, pickled by Ray."""
        return {k: getattr(self.engine, k) for k in SERVED_ATTRS if hasattr(self.engine, k)}


# NOTE: the Engine protocol's data attributes; an engine version lacking one just omits it
SERVED_ATTRS = ("model_name", "context_length", "eos_token_ids", "tokenizer",
                "tokenizer_config", "generation_config", "chat", "identity")
