"""The reaper of the durable stream log: ending (or adopting) the requests of servers whose
lease expired (issue 12 item 3; SPEC P2, P4, L2, L5, L6). Which terminal, and which orphans
are adopted instead, is :mod:`coda.durable.orphans`'s rule; this is how, fenced in Redis
(:data:`coda.durable.lua.REAP`, :data:`coda.durable.lua.ADOPT`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from redis.exceptions import RedisError

from coda.durable.codec import pack_event
from coda.durable.orphans import adoptable, orphan_terminal
from coda.stream import EventType, StreamEvent

log = logging.getLogger("coda.durable")


class Reaping:
    """The reaper half of :class:`~coda.durable.redis_log.RedisStreamLog` (its keys, scripts
    and lease; a mixin, so tests and callers keep one object)."""

    r: Any
    server_id: str
    fence: str
    retention_ms: int
    reaped_total: int
    adopted_total: int
    adopt_grace_ms: int
    # NOTE: set by a front end that can run an adoptable orphan (coda.durable.orphans):
    # called with the request id and its meta on the heartbeat thread, True if it adopted
    adopter: Callable[[str, dict[bytes, bytes]], bool] | None
    _reap: Any
    _adopt: Any

    def _k(self, kind: str, rid: str) -> str:
        raise NotImplementedError

    @property
    def _open(self) -> str:
        raise NotImplementedError

    def _lease(self, server: str) -> str:
        raise NotImplementedError

    def read(self, request_id: str, after_seq: int = -1) -> list[StreamEvent]:
        raise NotImplementedError

    def merge_keys(self, n: int) -> int:
        raise NotImplementedError

    def reap_orphans(self, on_reaped: Callable[[str], None] | None = None) -> int:
        """End (once) every open request whose owner's lease expired, with the terminal
        :func:`~coda.durable.orphans.orphan_terminal` chooses (``model_error``, or a cancel
        for the client an ingress held), committed tokens billed; a live peer's requests are
        never touched (P4, L2, L5, L6)."""
        n = 0
        for raw in self.r.smembers(self._open):
            try:
                reaped = self._reap_one(raw)
            except RedisError:
                raise  # NOTE: the heartbeat's to log and retry, not one request's
            except Exception:  # NOTE: a meta no server wrote (the log is a shared store):
                # logged and skipped, never the end of the heartbeat thread (then of the lease)
                log.exception("orphan not reaped: its meta is not readable",
                              extra={"request_id": raw.decode(errors="replace")})
                continue
            if reaped:
                n += 1
                if on_reaped is not None:
                    on_reaped(raw.decode())
        self.reaped_total += n
        return n

    def _reap_one(self, raw: bytes) -> bool:
        rid = raw.decode()
        owner = self.r.hget(self._k("meta", rid), "owner")
        if owner is None:
            self.r.srem(self._open, rid)  # NOTE: expired or never opened
            return False
        if owner.decode() == self.server_id or self.r.exists(self._lease(owner.decode())):
            return False
        return self.reap(rid, owner.decode())

    def reap(self, request_id: str, owner: str) -> bool:
        """Write the one terminal of an orphan of ``owner``; False if it was not one (any
        more). The script writes it only if what it was chosen from still holds: the owner's
        lease gone, no terminal, the log, the fencing token and ``detach`` as read here (a
        replica claiming the request meanwhile keeps it, :data:`coda.durable.lua.REAP`)."""
        meta = self.r.hgetall(self._k("meta", request_id))
        if meta.get(b"owner", b"").decode() != owner:
            return False  # NOTE: claimed or taken back since the caller looked
        if adoptable(meta) and not self._may_end_unadopted(request_id, meta):
            return False
        evs = self.read(request_id)
        terminal = orphan_terminal(meta, evs)
        run = [] if evs else [StreamEvent(request_id, 0, EventType.START, model="")]
        # NOTE: a stream starts with its start event (P1): when the owner died before even
        # that was durable, the reaper writes it first, in the same run as the terminal
        run.append(StreamEvent(request_id, len(evs) + len(run), EventType.TERMINAL,
                               terminal=terminal))
        rec = meta.get(b"rec", b"").decode()
        # NOTE: P3: after every run of this log, whatever this server's clock says
        key = max([self.merge_keys(1)] + [e.merge_key + 1 for e in evs if e.merge_key is not None])
        keys = [self._k("log", request_id), self._k("meta", request_id), self._open,
                self._lease(owner), self._k("rec", rec) if rec else ""]
        res = self._reap(keys=keys, args=[run[-1].seq, b"".join(pack_event(e) for e in run),
                                          run[0].seq, self.retention_ms, self.fence,
                                          request_id, meta.get(b"fence", b""),
                                          meta.get(b"detach", b""),
                                          key])
        return bool(res == 1)

    def _may_end_unadopted(self, request_id: str, meta: dict[bytes, bytes]) -> bool:
        """An adoptable orphan (:func:`~coda.durable.orphans.adoptable`): adopt it if this
        server can (False), else True once it has waited ``adopt_grace_ms`` since a reaper
        first saw it (Redis's clock) for one that can (an adopter of another model declines)."""
        if self.adopter is not None and self.adopter(request_id, meta):
            self.adopted_total += 1
            return False
        secs, micros = self.r.time()
        now = secs * 1000 + micros // 1000
        self.r.hsetnx(self._k("meta", request_id), "orphan_ms", now)
        seen = int(meta.get(b"orphan_ms", now))
        return bool(now - seen >= self.adopt_grace_ms)

    def adopt(self, request_id: str, meta: dict[bytes, bytes]) -> bool:
        """Become the ingress of the adoptable orphan whose meta was read as ``meta`` (one
        script, :data:`coda.durable.lua.ADOPT`): False if anything it was chosen from changed
        (a replica claimed it, a reaper ended it, another front end adopted it)."""
        owner = meta.get(b"owner", b"").decode()
        res = self._adopt(keys=[self._k("meta", request_id), self._lease(owner)],
                          args=[meta.get(b"fence", b""), self.server_id, self.fence])
        return bool(res == 1)
