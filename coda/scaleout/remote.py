"""The ingress's engine: N Ray Serve replicas behind the :class:`~coda.engine.protocol.Engine`
protocol (issue 12 items 1, 3; SPEC P1–P4, L2, L5, L6, C1).

Routing: least outstanding tokens (the output budget still to produce per replica), with
prefix-cache affinity — a prompt whose first block was last routed to a replica goes there
again unless it is ``affinity_slack`` tokens busier than the least loaded one. The decision is
on the handle (``route``) and in the server log.

Failures: a replica call that fails before the request's first frame is resubmitted to another
replica (same request, same seed: the counter RNG makes the output identical); after it, the
request ends exactly once with ``model_error``, billing the committed tokens — decided in
:mod:`coda.scaleout.failover` (with a durable log, given at construction, the log decides).

Transport: events come back through one streaming ``feed`` call per replica (and event loop),
carrying batches of every request's events (:mod:`coda.scaleout.feed`), not one Ray item per
event; a request starts with a unary ``submit`` call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import tokenizers

from coda.durable.mirror import feed
from coda.engine.plan import check_embedding_input, claimed_tokens
from coda.engine.protocol import ModelInfo
from coda.engine.types import EngineConfig, EngineStats, GenerationRequest
from coda.finish import CancelCause
from coda.models.source import model_key
from coda.scaleout.adopt import Adopter, open_routed
from coda.scaleout.failover import fail, settle
from coda.scaleout.feed import FeedClient
from coda.scaleout.remote_handle import RemoteHandle, resolve_calls
from coda.scaleout.routing_trace import RoutedTraceSink
from coda.stream import EventType, RequestStream, StreamEvent

if TYPE_CHECKING:
    from coda.durable.redis_log import RedisStreamLog
    from coda.scaleout.producer import DurableSpec

log = logging.getLogger("coda.scaleout")


class RemoteEngine:
    """Routes requests over Serve deployment handles ``replicas`` (one replica each).

    ``log`` (``--redis-url``): this ingress's :class:`~coda.durable.redis_log.RedisStreamLog`
    (its lease and fencing token); the replicas then write every request's log themselves and
    the first frame is the first durable delta. It is a
    :class:`~coda.durable.engine.LogWriting` engine, which the server's
    :class:`~coda.durable.engine.DurableEngine` passes through (issue 22 step 3)."""

    def __init__(self, replicas: list[Any], config: EngineConfig, *,
                 affinity_slack: int = 256, log: RedisStreamLog | None = None) -> None:
        self.replicas = replicas
        self.config = config
        # NOTE: the ingress holds the replica's own tokenizer and model data (pickled), so it
        # renders and encodes exactly as a replica would, without loading the weights
        attrs: dict[str, Any] = replicas[0].serving_attrs.remote().result()
        self.model_name: str = attrs["model_name"]
        self.model_aliases: frozenset[str] = attrs.get("model_aliases") or frozenset(
            {model_key(self.model_name)})
        self.context_length: int = attrs["context_length"]
        self.eos_token_ids: frozenset[int] = attrs["eos_token_ids"]
        self.tokenizer: tokenizers.Tokenizer = attrs["tokenizer"]
        for key, value in attrs.items():
            if not hasattr(self, key):
                setattr(self, key, value)
        self.affinity_slack = affinity_slack
        self.outstanding = [0] * len(replicas)
        self._affinity: dict[int, int] = {}
        self._lock = threading.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._live: dict[str, RemoteHandle] = {}
        self._feeds: dict[asyncio.AbstractEventLoop, list[FeedClient]] = {}
        self.num_requests_total = 0
        self.num_resubmits_total = 0
        self._embed_turn = itertools.count()
        self.owns_replicas = True  # NOTE: False when it joined replicas another ingress made
        self.log = log  # NOTE: None without --redis-url (coda.durable's redis is optional)
        if log is not None:  # NOTE: runs a dead front end's detached requests (adopt.py)
            log.adopter = Adopter(self)
        self.trace = RoutedTraceSink(self, config.recent_traces or 64)

    # -- Engine protocol -----------------------------------------------------------------
    def start(self) -> None:
        return None

    def shutdown(self, timeout: float = 30.0) -> None:
        """End every in-flight request (cancelled, cause shutdown) and wait for its terminal;
        the replicas themselves belong to the Serve applications (``coda serve`` stops them).
        With a stream log, a detached request (background, or ``on_disconnect=continue``) is
        left running on its replica, which writes the rest of it into the log, so an ingress
        restart (SIGTERM) does not end it (issue 12 item 3). Called off the event loop (the
        pumps keep running on it)."""
        live = [h for h in list(self._live.values())
                if not h.stream.closed and not (h.detach and self.log is not None)]
        for h in live:
            h.cancel(CancelCause.SHUTDOWN)
        deadline = time.monotonic() + timeout
        while any(not h.stream.closed for h in live) and time.monotonic() < deadline:
            time.sleep(0.01)

    def model_info(self) -> ModelInfo:
        info: ModelInfo | None = getattr(self, "served_model_info", None)
        if info is None:  # NOTE: a replica of an engine version without it
            return ModelInfo(self.model_name, self.context_length, self.eos_token_ids)
        return dataclasses.replace(info, name=self.model_name, context_length=self.context_length,
                                   eos_token_ids=self.eos_token_ids)

    async def embed(self, token_ids: list[int]) -> list[float]:
        """On any replica (they serve the same weights), in turn; the replica checks the ids
        against its vocabulary. A cancelled await (the client gone) cancels the call there
        too: its engine drops the embedding at its next chunk, or before it starts (C1)."""
        check_embedding_input(token_ids, self.context_length)
        idx = next(self._embed_turn) % len(self.replicas)
        call = self.replicas[idx].embed.remote(token_ids)
        try:
            out: list[float] = await call
        except asyncio.CancelledError:
            # NOTE: awaiting a Serve response does not cancel it when the awaiting task is
            # cancelled (the replica ran every embedding of a client that had left)
            call.cancel()
            raise
        return out

    def num_queued(self, incoming: int = 0) -> int:
        """Seen from the ingress: per replica, its requests not ended past its
        ``max_num_seqs`` batch slots; ``incoming`` wait for what is past the slots free on
        all of them (routing spreads them)."""
        per = [0] * len(self.replicas)
        for h in list(self._live.values()):
            if not h.stream.closed and 0 <= h.replica < len(per):
                per[h.replica] += 1
        cap = self.config.max_num_seqs
        free = sum(max(0, cap - n) for n in per)
        return sum(max(0, n - cap) for n in per) + max(0, incoming - free)

    def stats(self) -> EngineStats:
        parts: list[EngineStats] = [r.stats.remote().result(timeout_s=10) for r in self.replicas]
        return EngineStats(
            num_running=sum(p.num_running for p in parts),
            num_waiting=sum(p.num_waiting for p in parts),
            kv_cache_usage=max(p.kv_cache_usage for p in parts),
            num_blocks=sum(p.num_blocks for p in parts),
            num_free_blocks=sum(p.num_free_blocks for p in parts),
            num_requests_total=self.num_requests_total,
            num_preemptions_total=sum(p.num_preemptions_total for p in parts),
            kv_cache_reserved_bytes=sum(p.kv_cache_reserved_bytes for p in parts),
            kv_cache_committed_bytes=sum(p.kv_cache_committed_bytes for p in parts),
            embed_chunks_total=sum(p.embed_chunks_total for p in parts),
            embeds_cancelled_total=sum(p.embeds_cancelled_total for p in parts))

    def attach(self, request_id: str, after_seq: int = -1) -> AsyncIterator[StreamEvent]:
        raise KeyError(request_id)  # NOTE: resume is the durable log's (--redis-url)

    def cancel(self, request_id: str, cause: CancelCause = CancelCause.CLIENT) -> bool:
        handle = self._live.get(request_id)
        return handle.cancel(cause) if handle is not None else False

    def detach(self, request_id: str) -> None:
        """P4 ``continue`` / background: ``request_id`` runs on without a client; with a log,
        also if this ingress dies (its replica writes the rest instead of cancelling it)."""
        handle = self._live.get(request_id)
        if handle is not None:
            handle.detach = True
        if self.log is not None:
            self.log.detach(request_id)

    def mark_cancel(self, request_id: str, cause: CancelCause) -> None:
        """With a log, record the cancel there too: a cancel that overtakes the replica's
        claim is applied when the replica claims the request (C1)."""
        if self.log is None:
            return
        try:
            self.log.request_cancel(request_id, cause.value)
        except Exception:  # NOTE: redis.RedisError: the direct cancel still goes out
            log.warning("cancel not recorded in the stream log", exc_info=True,
                        extra={"request_id": request_id})

    def cancel_anywhere(self, request_id: str, cause: CancelCause = CancelCause.CLIENT
                        ) -> bool:
        """Cancel ``request_id`` on whichever replica runs it, also one another ingress
        submitted (a record rebuilt from the log): the cancel goes to every replica, the one
        running it ends it and writes the terminal into the log (C1)."""
        if self.cancel(request_id, cause):
            return True
        self.mark_cancel(request_id, cause)
        calls = [r.cancel.remote(request_id, cause) for r in self.replicas]
        # NOTE: resolved off the event loop (a Serve call left unresolved may not be delivered)
        threading.Thread(target=resolve_calls, args=(calls,), daemon=True).start()
        return True

    def submit(self, req: GenerationRequest) -> RemoteHandle:
        return self._submit(req, adopted=False)

    def submit_adopted(self, req: GenerationRequest) -> RemoteHandle:
        """Run a detached request this front end adopted (:mod:`coda.scaleout.adopt`): it
        is already open in the log, owned by this front end."""
        return self._submit(req, adopted=True)

    def _submit(self, req: GenerationRequest, *, adopted: bool) -> RemoteHandle:
        rid = req.request_id or f"req-{uuid.uuid4().hex[:16]}"
        req = replace(req, request_id=rid)
        # NOTE: the same backpressure bound as a local stream (P6)
        stream = RequestStream(rid, req.backpressure)
        # NOTE: P3: with a log, the replica forwards its durable copy with each run's merge
        # key, and choices of one n > 1 request may come through different feeds (replicas)
        # at different times: merged by key, each event once every running choice is past it
        # (coda.reader.settled), the order a replay from the log has
        stream.log_ordered = self.log is not None
        handle = RemoteHandle(rid, stream, len(req.prompt_token_ids), self, detach=adopted)
        self.num_requests_total += 1
        self._live[rid] = handle
        # NOTE: routed at submit, so the decision is known (and logged) before any event
        handle.replica, handle.route = self.choose(req, set())
        self.trace.routed(rid, handle.route)
        log.info("routed", extra={"request_id": rid, **handle.route})
        task = asyncio.get_running_loop().create_task(self._pump(req, handle, adopted))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: self._live.pop(rid, None))
        return handle

    def _feed(self, idx: int) -> FeedClient:
        """Replica ``idx``'s feed on the running loop (opened on first use: a server runs
        one loop, tests and benchmarks may run several in turn)."""
        loop = asyncio.get_running_loop()
        feeds = self._feeds.get(loop)
        if feeds is None:
            for old in [lp for lp in self._feeds if lp.is_closed()]:
                del self._feeds[old]
            feeds = self._feeds[loop] = [
                FeedClient(r.options(stream=True, method_name="feed").remote,
                           r.submit.remote) for r in self.replicas]
        return feeds[idx]

    # -- routing -------------------------------------------------------------------------
    def choose(self, req: GenerationRequest, exclude: set[int]) -> tuple[int, dict[str, Any]]:
        budget = claimed_tokens(req, self.config.default_max_tokens)
        key = hash(tuple(req.prompt_token_ids[:self.config.block_size]))
        with self._lock:
            cands = [i for i in range(len(self.replicas)) if i not in exclude]
            least = min(cands, key=lambda i: self.outstanding[i])
            pref = self._affinity.get(key)
            pick, why = least, "least_outstanding_tokens"
            if (pref in cands and pref is not None and self.outstanding[pref]
                    <= self.outstanding[least] + self.affinity_slack):
                pick, why = pref, "prefix_affinity"
            self._affinity[key] = pick
            route = {"replica": pick, "reason": why, "outstanding": list(self.outstanding)}
            self.outstanding[pick] += budget
        return pick, route

    def _done(self, idx: int, req: GenerationRequest) -> None:
        with self._lock:
            self.outstanding[idx] -= claimed_tokens(req, self.config.default_max_tokens)

    async def _pump(self, req: GenerationRequest, h: RemoteHandle, adopted: bool) -> None:
        tried: set[int] = set()
        idx = h.replica
        if self.log is not None and not adopted:
            try:
                await asyncio.to_thread(open_routed, self.log, req, h.detach, self.model_name)
            except Exception as exc:  # NOTE: redis.RedisError: nothing was sent, nothing seen
                log.exception("stream log unreachable; request not started",
                              extra={"request_id": h.request_id})
                fail(h, exc)
                self._done(idx, req)
                return
        while True:
            got_delta = False
            failure: BaseException | None = None
            try:
                async for evs in self._feed(idx).events(req, h.request_id, self._spec(h),
                                                        h.route):
                    got_delta = got_delta or any(ev.type is EventType.DELTA for ev in evs)
                    feed(h.stream, evs)  # NOTE: one append and one wake-up per message
            except Exception as exc:  # NOTE: a dead replica (RayActorError, ...)
                failure = exc
            if failure is None and h.stream.closed:
                self._done(idx, req)
                return
            failure = failure or RuntimeError("replica stream ended without a terminal")
            tried.add(idx)
            can_retry = len(tried) < len(self.replicas)
            if await settle(h, self.log, self.model_name, got_delta, failure,
                              can_retry) and can_retry:
                self.num_resubmits_total += 1
                log.warning("replica failed before the first frame; resubmitting",
                            extra={"request_id": h.request_id, "replica": idx})
                self._done(idx, req)
                idx, route = self.choose(req, tried)
                h.replica, h.route = idx, {**route, "rule": route["reason"],
                                           "reason": "retry_after_failure",
                                           "resubmitted_from": sorted(tried)}
                self.trace.routed(h.request_id, h.route)
                log.info("routed", extra={"request_id": h.request_id, **h.route})
                continue
            self._done(idx, req)
            return

    def _spec(self, h: RemoteHandle) -> DurableSpec | None:
        if self.log is None:
            return None
        from coda.scaleout.producer import DurableSpec

        return DurableSpec(self.log.url, self.log.prefix, self.log.retention_ms / 1000,
                           self.log.lease_ttl_ms / 1000, self.log.fence)
