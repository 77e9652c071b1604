"""A replica's side of the durable stream log (issue 12 items 2, 3; SPEC P2, P4, L2, L5, L6).

With ``--redis-url`` the replica that runs a request is the one that writes its log: it claims
the request from the ingress that opened it (compare-and-set on the fencing token,
:meth:`~coda.durable.redis_log.RedisStreamLog.take`), holds its own lease, and mirrors the
engine's stream into Redis with its own :class:`~coda.durable.mirror.LogMirror`. The ingress
receives only what Redis acknowledged, so "the first frame" (seed 004) is the first delta
durably appended, and the log keeps being written if the ingress dies.

Cancels through another ingress (a record rebuilt from the log) are broadcast to the replicas
and also recorded in the request's meta (``cancel``), applied when the request is claimed or at
the next check, so a cancel that overtakes the request is not lost.

Orphans of a dead ingress: every ``lease_ttl_s / 3`` the replica checks, for each request it
runs, whether the lease of the ingress that routed it (``via``) still exists. If not, the
client's connection died with it: a request marked ``detach`` (background, or P4
``on_disconnect=continue``) runs on and writes its own terminal; any other is cancelled (cause
disconnect) and gets its ``cancelled`` terminal. A live ingress's requests are never touched.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from coda.durable.mirror import DurableCopy, LogMirror
from coda.durable.redis_log import RedisStreamLog
from coda.finish import CancelCause
from coda.stream import StreamClosed

log = logging.getLogger("coda.scaleout")


@dataclass(frozen=True)
class DurableSpec:
    """What a replica needs to write a request's log: where the log is and how it is kept
    (the ingress's settings) and the fencing token the request carries when it is claimed
    (its current owner's, normally the ingress's). The API record it belongs to is linked by
    the ingress's store (:meth:`~coda.durable.redis_log.RedisStreamLog.put_record`)."""

    url: str
    prefix: str
    retention_s: float
    lease_ttl_s: float
    fence: str


class NotOwner(RuntimeError):
    """The request was ended or taken over before this replica could claim it."""


# NOTE: how often a replica checks its running requests' ingresses and cross-ingress cancels
# (P4, C1): at most this, or a lease / 3 if shorter. A gone ingress is seen once its lease
# lapses (``--lease-ttl-s``); then its cancel-policy orphans end within this, not a third of a
# lease later (3.3 s at the default 10 s, 20 s at the fault matrix's 60 s). Idle, a check is
# no Redis call; else one pipelined round trip.
ORPHAN_WATCH_S = 1.0


@dataclass
class _Running:
    handle: Any
    ingress: str


class ReplicaLog:
    """One replica's lease, mirror and orphan watch on one Redis (log settings of ``spec``)."""

    def __init__(self, spec: DurableSpec, server_id: str, *, steps: Any = None) -> None:
        self.log = RedisStreamLog(spec.url, prefix=spec.prefix, retention_s=spec.retention_s,
                                  lease_ttl_s=spec.lease_ttl_s, server_id=server_id)
        self.log.start()
        # NOTE: steps: the replica's engine, so the mirror flushes once per engine step
        self.mirror = LogMirror(self.log, steps=steps)
        self._running: dict[str, _Running] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.closed = False
        self.cancelled_orphans = 0
        threading.Thread(target=self._watch, name="coda-orphan-watch", daemon=True).start()

    def begin(self, engine: Any, req: Any, spec: DurableSpec,
              loop: asyncio.AbstractEventLoop) -> DurableCopy:
        """Claim ``req`` in the log, submit it to ``engine`` and mirror it (observed on the
        replica's ``loop``); returns the copy the call forwards (durable events only). Raises
        :class:`NotOwner` if the claim fails."""
        rid = req.request_id
        code, _ = self.log.take(rid, spec.fence)
        if code != 1:
            raise NotOwner(f"{rid}: not claimable (code {code})")
        meta = self.log.meta(rid)
        handle = engine.submit(req)
        if "cancel" in meta:  # NOTE: cancelled through another ingress before it got here
            handle.cancel(CancelCause(meta["cancel"]))
        ingress = meta.get("via", "")

        held: list[DurableCopy] = []

        def fenced() -> None:  # NOTE: on the mirror's thread
            handle.cancel(CancelCause.SHUTDOWN)
            if held:
                threading.Thread(target=self._follow_peer, args=(held[0],), daemon=True,
                                 name="coda-fenced-follow").start()

        copy = self.mirror.watch(handle.stream, record_id="",
                                 prompt_tokens=len(req.prompt_token_ids), on_fenced=fenced,
                                 opened=True, ack_on_write=True, loop=loop)
        held.append(copy)
        with self._lock:
            self._running[rid] = _Running(handle, ingress)
        return copy

    def _follow_peer(self, copy: DurableCopy) -> None:
        """A request this replica ran was taken over (its lease lapsed while it was alive, and
        a reaper or an ingress fenced it out): what the ingress reads follows the log to the
        terminal the peer wrote, so the ingress and its client end with the log's terminal
        instead of waiting for ours, which the log refuses (issue 24: found at 1,000 streams
        on 2 loaded cores, a live replica's heartbeat stalled past a 2 s lease)."""
        rid = copy.request_id
        deadline = time.monotonic() + 3 * self.log.lease_ttl_ms / 1000 + 30
        while not copy.closed and time.monotonic() < deadline:
            try:
                evs = self.log.wait(rid, copy.last_seq, 1.0)
            except redis.RedisError:
                time.sleep(0.5)
                continue
            try:
                copy.extend(evs)
            except (ValueError, StreamClosed):
                # NOTE: the reaper ended it before even its start was durable (a log holding
                # only a terminal at seq 0), which a stream cannot hold: end the copy with
                # that terminal after a start of its own (the client ends; its ids differ)
                term = next((e.terminal for e in evs if e.terminal is not None), None)
                if term is not None and copy.last_seq < 0:
                    copy.start("")
                    copy.close(term)
                log.warning("fenced request's log does not extend its copy",
                            extra={"request_id": rid})
                return
        if not copy.closed:
            log.warning("fenced request's log has no terminal; the ingress settles it",
                        extra={"request_id": rid})

    def _watch(self) -> None:
        period = min(self.log.lease_ttl_ms / 3000, ORPHAN_WATCH_S)
        while not self._stop.wait(period):
            try:
                self.check_orphans()
            except redis.RedisError:
                with self._lock:
                    idle = all(r.handle.stream.closed for r in self._running.values())
                if idle:  # NOTE: that Redis is gone and nothing here needs it: let go
                    log.warning("stream log unreachable; closing this replica's use of it")
                    self.close()
                    return
                log.exception("orphan watch failed")

    def close(self) -> None:
        """Stop the lease, the mirror and the watch (a later request opens a fresh one)."""
        self.closed = True
        self._stop.set()
        self.log.stop(release=False)
        self.mirror.flush(timeout=1.0)

    def check_orphans(self) -> int:
        """Cancel every running request whose ingress's lease is gone and which is not
        detached (P4); returns how many were cancelled."""
        with self._lock:
            for rid in [r for r, run in self._running.items() if run.handle.stream.closed]:
                del self._running[rid]
            todo = list(self._running.items())
        if not todo:
            return 0
        pipe = self.log.r.pipeline(transaction=False)
        for rid, run in todo:
            pipe.exists(self.log._lease(run.ingress))
            pipe.hmget(self.log._k("meta", rid), "detach", "cancel")
        replies = pipe.execute()
        n = 0
        for k, (rid, run) in enumerate(todo):
            alive, (detached, cancel) = replies[2 * k], replies[2 * k + 1]
            if cancel is not None:  # NOTE: a cancel recorded by another ingress (C1)
                run.handle.cancel(CancelCause(cancel.decode()))
                continue
            if alive or detached is not None or not run.ingress:
                continue
            log.warning("the ingress of this request is gone; cancelling (P4 cancel)",
                        extra={"request_id": rid, "ingress": run.ingress})
            if run.handle.cancel(CancelCause.DISCONNECT):
                n += 1
        self.cancelled_orphans += n
        return n
