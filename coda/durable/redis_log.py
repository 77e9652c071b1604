"""The durable stream log on Redis Streams, with owner leases and fencing (issue 12 item 2, 3;
SPEC P1–P3, L2, L5, L6).

Keys (``prefix`` default ``coda:``; ``{rid}`` is a hash tag, so one request's keys share a
cluster slot and the log shards by request id):

- ``log:{rid}`` — a Redis stream, one entry per run of consecutive events ``a..b`` (a flush of
  the mirror), entry id ``0-(b+1)`` (ids must be above ``0-0``), fields ``a`` (first seq) and
  ``v2`` (the events, :func:`coda.durable.codec.pack_event` concatenated) and ``m`` (the run's
  merge key, :meth:`RedisStreamLog.merge_keys`; absent in logs written before it) — see
  :mod:`coda.durable.lua`;
- ``meta:{rid}`` — hash: ``last`` (last seq appended), ``term`` (seq of the terminal, once
  written), ``owner`` (server id), ``fence`` (the owner's fencing token), ``prompt`` (prompt
  tokens, for billing an orphan), ``rec`` (its record id), ``send_s`` (the first delivery's
  network send time, :meth:`keep_send_s`); with replicas ``ingress``, ``via``,
  ``detach``, ``cancel`` and, for adopting an orphan (:mod:`coda.durable.orphans`), ``req``,
  ``model``, ``adopted``, ``orphan_ms``;
- ``rec:{id}`` — the JSON descriptor of an API record (what re-renders it on another ingress);
- ``open`` — the set of request ids without a terminal; ``lease:{server}`` — a server's lease
  (its fencing token, expiring after ``lease_ttl_s`` without a heartbeat); ``fence`` — the
  fencing-token counter.

Exactly once. Every append is one Lua script call, atomic in Redis, carrying the runs of all
requests of one flush: per run, seqs not above ``last`` are duplicates of a retried append and
skipped (a partly duplicated run is cut at the first new event), a run that would leave a gap
is refused (-2), anything once ``term`` is set (the single terminal, P2), and any writer whose
fencing token is not the request's current one (-1: a server whose lease expired and whose
requests a peer ended). The terminal, the ``open`` removal and the retention TTLs are set in
the same script. Ending an
orphan (:meth:`RedisStreamLog.reap`) is also one script, which re-checks inside Redis that the
owner's lease is gone, that no terminal exists and that the log, the fencing token and
``detach`` did not change since it was read; two servers reaping at once therefore write one
terminal between them, and a replica that claims the request meanwhile keeps it. Which
terminal (``model_error``, or the cancel of a client an ingress held) is
:mod:`coda.durable.orphans`'s rule.

Durability: Redis configured with AOF and ``appendfsync everysec`` (the test fixture and the
docs' setup do so) loses at most the last second of appends on a Redis crash (power loss or
kill -9 of Redis); a lost tail is then re-appended by the owner if it is still alive (appends
are idempotent), or the request is ended by the reaper from what survived. Retention: a
request's keys expire ``retention_s`` (default 600 s) after its terminal.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis
from redis.exceptions import NoScriptError

from coda.durable import append, lua
from coda.durable.codec import decode_event, unpack_events
from coda.durable.log_records import RecordStoring
from coda.durable.orphans import ADOPT_GRACE_LEASES
from coda.durable.reaper import Reaping
from coda.finish import Terminal
from coda.stream import StreamEvent

log = logging.getLogger("coda.durable")

class Fenced(RuntimeError):
    """This server no longer owns the request: a peer ended it after our lease expired."""


class RedisStreamLog(Reaping, RecordStoring):
    """A :class:`~coda.engine.protocol.StreamLog` on Redis Streams, plus this server's lease.

    ``server_id`` names the lease; :meth:`start` takes it (a fresh fencing token) and runs the
    heartbeat, which also reaps the requests of servers whose lease expired."""

    def __init__(self, url: str, *, prefix: str = "coda:", retention_s: float = 600.0,
                 lease_ttl_s: float = 10.0, server_id: str | None = None) -> None:
        if not retention_s > 0 or not lease_ttl_s > 0:
            raise ValueError("retention_s and lease_ttl_s must be > 0")
        # NOTE: typed Any: redis-py annotates replies as bytes | str | Awaitable (sync or async)
        self.r: Any = redis.Redis.from_url(url)
        self.url = url
        self.prefix = prefix
        self.retention_ms = int(retention_s * 1000)
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.server_id = server_id or uuid.uuid4().hex[:12]
        self.fence = ""
        self._reap = self.r.register_script(lua.REAP)
        self._take = self.r.register_script(lua.TAKE)
        self._put_record = self.r.register_script(lua.PUT_RECORD)
        self._keep_send_s = self.r.register_script(lua.KEEP_SEND_S)
        self._adopt = self.r.register_script(lua.ADOPT)
        self.adopter: Callable[[str, dict[bytes, bytes]], bool] | None = None
        self.adopt_grace_ms = ADOPT_GRACE_LEASES * self.lease_ttl_ms
        self.adopted_total = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reaped_total = 0
        self._keys_lock = threading.Lock()
        self._last_key = 0

    # -- keys ----------------------------------------------------------------------------
    def _k(self, kind: str, rid: str) -> str:
        return f"{self.prefix}{kind}:{{{rid}}}"

    @property
    def _open(self) -> str:
        return f"{self.prefix}open"

    def _lease(self, server: str) -> str:
        return f"{self.prefix}lease:{server}"

    # -- lease ---------------------------------------------------------------------------
    def start(self) -> None:
        """Take this server's lease (a new fencing token), reap orphans, start heartbeating."""
        self.fence = str(self.r.incr(f"{self.prefix}fence"))
        self.heartbeat()
        self.reap_orphans()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="coda-lease", daemon=True)
        self._thread.start()

    def stop(self, *, release: bool = True) -> None:
        """Stop heartbeating; ``release`` drops the lease at once (a clean shutdown, whose
        requests all have terminals already)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        if release:
            self.r.delete(self._lease(self.server_id))

    def heartbeat(self) -> None:
        self.r.set(self._lease(self.server_id), self.fence, px=self.lease_ttl_ms)

    def _beat(self) -> None:
        period = self.lease_ttl_ms / 3000
        while not self._stop.wait(period):
            try:
                self.heartbeat()
                self.reap_orphans()
            except redis.RedisError:
                log.exception("lease heartbeat failed")

    # -- producer side -------------------------------------------------------------------
    def open(self, request_id: str, *, prompt_tokens: int, record_id: str | None = None,
             detached: bool = False, ingress: bool = False, request: bytes = b"",
             model: str = "") -> None:
        """Declare ``request_id`` owned by this server (before its first append).
        ``detached``: it runs on without a client (P4 ``continue``, background). ``ingress``:
        this server only routes it to a replica, which claims it (:meth:`take`); while it
        still owns it, its death is its client's disconnect, or for a detached request an
        adoption by a surviving front end, which runs it from ``request`` (what was asked, as
        the ingress sends it to a replica) if it serves ``model`` (:mod:`coda.durable.orphans`)."""
        pipe = self.r.pipeline(transaction=True)
        fields: dict[str, str | int | bytes] = {"owner": self.server_id, "fence": self.fence,
                                                "prompt": prompt_tokens}
        if ingress:
            fields["ingress"] = self.server_id
        if request:
            fields.update(req=request, model=model)
        if record_id:  # NOTE: else linked later by put_record (never overwritten with "")
            fields["rec"] = record_id
        if detached:
            fields["detach"] = 1
        pipe.hset(self._k("meta", request_id), mapping=fields)
        pipe.sadd(self._open, request_id)
        pipe.execute()

    def take(self, request_id: str, expect_fence: str) -> tuple[int, int]:
        """Become the request's owner if its fencing token is ``expect_fence`` (one script):
        ``(1, last)`` taken, ``(0, last)`` it has its terminal, ``(-1, last)`` someone else
        owns it. ``last`` is the last seq in the log (-1: nothing yet)."""
        code, last = self._take(keys=[self._k("meta", request_id)],
                                args=[expect_fence, self.server_id, self.fence])
        return int(code), int(last)

    def detach(self, request_id: str) -> None:
        """Mark ``request_id`` as running on without a client (P4 ``continue``)."""
        self.r.hset(self._k("meta", request_id), "detach", 1)

    def request_cancel(self, request_id: str, cause: str) -> None:
        """Record a cancel for whichever server runs ``request_id`` (C1 from an ingress that
        does not own it); the owner applies it when it claims the request or at its next
        check."""
        self.r.hset(self._k("meta", request_id), "cancel", cause)

    def meta(self, request_id: str) -> dict[str, str]:
        """The request's meta hash, decoded (empty once expired or if never opened), but for
        the stored request (``req``: binary, an adopter's, :meth:`open`)."""
        return {k.decode(): v.decode() for k, v in self.r.hgetall(
            self._k("meta", request_id)).items() if k != b"req"}

    def append_many(self, events: list[StreamEvent], record_id: str | None = None
                    ) -> list[bool]:
        """Append ``events`` (in seq order) in one round trip; True for each newly written."""
        return [r is True for r in self.append_batch([(ev, record_id) for ev in events])]

    def append_batch(self, items: list[tuple[StreamEvent, str | None]]
                     ) -> list[bool | Fenced]:
        """Append events of any requests (each request's in seq order) in one round trip: one
        script call for the whole batch (up to ``RUNS_PER_CALL`` runs each), one stream entry
        per run of consecutive events of one request (:mod:`coda.durable.lua`). Per event:
        True written, False a duplicate (or after the terminal), a :class:`Fenced` if a peer
        owns the request now; a gap raises (a writer bug)."""
        batch = append.runs(items)
        out: list[bool | Fenced] = []
        for (evs, _), (code, prev_last) in zip(batch, self.append_runs(batch), strict=True):
            for ev in evs:
                out.append(Fenced(ev.request_id) if code == -1
                           else code == 1 and ev.seq > prev_last)
        return out

    def merge_keys(self, n: int) -> int:
        """The first of ``n`` fresh merge keys (P3; :func:`coda.reader.merge_order`): strictly
        increasing over every call of this process, and near the wall clock in nanoseconds,
        so a request taken over by a peer keeps its runs' order."""
        with self._keys_lock:
            first = max(time.time_ns(), self._last_key + 1)
            self._last_key = first + n - 1
        return first

    def append_runs(self, batch: list[append.Run], first_key: int | None = None
                    ) -> list[tuple[int, int]]:
        """Append ``batch`` (runs: consecutive events of one request, a terminal only last,
        with the run's record id) in one round trip; per run ``(code, last seq before)``,
        codes as :data:`coda.durable.lua.APPEND`'s (1 written or a duplicate, 0 after the
        terminal, -1 fenced); a gap raises (a writer bug). What the mirror calls: it has its
        runs already (one per request of a flush), so nothing is cut or expanded per event.
        Run ``i`` is written with merge key ``first_key + i`` (None: fresh ones)."""
        if first_key is None:
            first_key = self.merge_keys(len(batch))
        calls = append.frame(batch, self.prefix, self.retention_ms, self.fence, first_key)
        replies = self._send(calls)
        out = list(append.outcomes(replies))
        for (evs, _), (code, _last) in zip(batch, out, strict=True):
            if code == -2:
                raise RuntimeError(
                    f"{evs[0].request_id}: append of seq {evs[0].seq} leaves a gap")
        return out

    def _send(self, calls: list[bytes]) -> list[bytes]:
        """Send ``calls`` (framed ``EVALSHA`` calls) in one round trip; a call answered
        ``NOSCRIPT`` (the script is not cached: a restarted Redis) is sent again with the
        script's body (it did not run, so this is no retry of a write)."""
        pool = self.r.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_packed_command(calls)  # NOTE: a list of chunks, sent in turn
            replies: list[bytes | None] = []
            missing = []
            for k in range(len(calls)):
                try:
                    replies.append(conn.read_response())
                except NoScriptError:
                    replies.append(None)
                    missing.append(k)
            if missing:
                conn.send_packed_command([append.with_body(calls[k]) for k in missing])
                for k in missing:
                    replies[k] = conn.read_response()
        except BaseException:
            conn.disconnect()  # NOTE: replies may be left unread; never reuse the connection
            raise
        finally:
            pool.release(conn)
        return [r for r in replies if r is not None]

    def append(self, event: StreamEvent, record_id: str | None = None) -> bool:
        """Append one event (idempotent); raises :class:`Fenced` if a peer took it over."""
        res = self.append_batch([(event, record_id)])[0]
        if isinstance(res, Fenced):
            raise res
        return res

    # -- reader side ---------------------------------------------------------------------
    def read(self, request_id: str, after_seq: int = -1) -> list[StreamEvent]:
        """The events after ``after_seq`` (an entry holding seqs on both sides of it is cut)."""
        # NOTE: an entry's id is its last seq + 1, so this takes every entry with a seq above
        rows = self.r.xrange(self._k("log", request_id), min=f"0-{after_seq + 2}")
        return _decode(request_id, rows, after_seq)

    def wait(self, request_id: str, after_seq: int, timeout_s: float) -> list[StreamEvent]:
        """Events after ``after_seq``, blocking up to ``timeout_s`` for the first one."""
        res = self.r.xread({self._k("log", request_id): f"0-{after_seq + 1}"},
                           block=max(1, int(timeout_s * 1000)))
        return [ev for _, rows in res for ev in _decode(request_id, rows, after_seq)]

    def terminal(self, request_id: str) -> Terminal | None:
        seq = self.r.hget(self._k("meta", request_id), "term")
        if seq is None:
            return None
        evs = self.read(request_id, int(seq) - 1)
        return evs[0].terminal if evs else None

    def exists(self, request_id: str) -> bool:
        return bool(self.r.exists(self._k("meta", request_id)))


def _decode(request_id: str, rows: list[tuple[bytes, dict[bytes, bytes]]],
            after_seq: int) -> list[StreamEvent]:
    """The events of stream entries (v2 runs, or v1 single JSON events), those after
    ``after_seq`` only, each with its run's merge key (an entry written before merge keys has
    none: such a log merges as it is read, P3)."""
    out: list[StreamEvent] = []
    for _, fields in rows:
        blob = fields.get(b"v2")
        evs = unpack_events(request_id, blob) if blob is not None else [
            decode_event(fields[b"e"])]
        key = fields.get(b"m")
        if key is not None:
            evs = [keyed(ev, int(key)) for ev in evs]
        out += [ev for ev in evs if ev.seq > after_seq]
    return out


def keyed(ev: StreamEvent, merge_key: int) -> StreamEvent:
    """``ev`` with ``merge_key`` (a dict copy: a frozen dataclass keeps its fields there)."""
    copy = object.__new__(StreamEvent)
    copy.__dict__.update(ev.__dict__, merge_key=merge_key)
    return copy
