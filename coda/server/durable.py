"""The server's side of the durable stream log (issue 12 item 2, 3; SPEC P3, P4, L2).

With ``--redis-url`` every request a route stores is mirrored into the Redis log, with a
descriptor of its API record (kind, model, extras, the ids of its engine requests). A record
this ingress does not hold (another ingress made it, or this server restarted) is rebuilt from
the log: its handles are :class:`LoggedHandle` s whose streams are fed from Redis, so
``Last-Event-ID``, ``/v1/streams/{id}`` and ``GET /v1/responses/{id}`` (with
``stream=true&starting_after=n``) serve a resume on any ingress. Without a URL nothing here is
imported and the in-memory log is the only one (today's behaviour).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from coda.durable.mirror import LogFollower, LogMirror
from coda.durable.redis_log import RedisStreamLog
from coda.finish import CancelCause
from coda.reader import StreamReading
from coda.server.render_spec import spec_data, spec_from_data
from coda.server.state import Record
from coda.stream import RequestStream

log = logging.getLogger("coda.server")


class LoggedHandle(StreamReading):
    """An engine handle rebuilt from the log (an :class:`~coda.engine.protocol.EngineHandle`):
    readable and resumable. Cancel reaches the request only where this ingress shares the
    producer's engines (``--replicas``: any replica may run it, ``cancel_remote``); else it is
    the owning server's and answers False here."""

    def __init__(self, follower: LogFollower,
                 cancel_remote: Callable[[str, CancelCause], bool] | None = None) -> None:
        self._follower = follower
        self._cancel_remote = cancel_remote
        self.request_id = follower.stream.request_id
        self.stream: RequestStream = follower.stream
        self.prompt_tokens = 0  # NOTE: billed by the owner; the terminal carries it

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        if self._cancel_remote is None or self.stream.closed:
            return False
        return self._cancel_remote(self.request_id, cause)


class MirroredHandle(StreamReading):
    """A local engine handle whose readers see its durable copy (an
    :class:`~coda.engine.protocol.EngineHandle`); cancel goes to the engine."""

    def __init__(self, inner: Any, copy: RequestStream) -> None:
        self._inner = inner
        self.request_id: str = inner.request_id
        self.prompt_tokens: int = inner.prompt_tokens
        self.stream = copy

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        return bool(self._inner.cancel(cause))


class ServerDurable:
    """The lease, the mirror and record rebuilding of one server (ingress)."""

    def __init__(self, url: str, *, retention_s: float = 600.0, lease_ttl_s: float = 10.0,
                 prefix: str = "coda:") -> None:
        self.log = RedisStreamLog(url, prefix=prefix, retention_s=retention_s,
                                  lease_ttl_s=lease_ttl_s)
        self.mirror: LogMirror | None = None
        # NOTE: set by the app when its engine can cancel a request it did not submit
        self.cancel_remote: Callable[[str, CancelCause], bool] | None = None

    def start(self) -> None:
        self.log.start()
        self.mirror = LogMirror(self.log)

    def stop(self) -> None:
        """After the engine has ended every request: write the rest, then drop the lease."""
        if self.mirror is not None:
            self.mirror.flush()
        self.log.stop(release=True)

    def watch(self, record: Record) -> None:
        """Mirror ``record``'s streams and store its descriptor (called when it is stored).
        Its handles are swapped for :class:`MirroredHandle` s, so every reader of the record
        (SSE, the non-streaming wait, replays) sees only what is durably in the log."""
        if self.mirror is None or isinstance(record.handles[0], LoggedHandle | MirroredHandle):
            return
        self.log.put_record(record.id, {
            "kind": record.kind, "created": record.created, "model": record.model,
            "background": record.background, "extra": spec_data(record.spec),
            "handles": [h.request_id for h in record.handles]})
        if all(getattr(h, "durable", False) for h in record.handles):
            # NOTE: replicas write these logs themselves (coda.scaleout.producer); their
            # streams already hold only durable events. Read before the first replica call.
            for h in record.handles:
                h.record_id, h.detach = record.id, record.background
            return
        mirrored: list[Any] = []
        for h in record.handles:
            def fenced(h: Any = h) -> None:
                h.cancel(CancelCause.SHUTDOWN)

            copy = self.mirror.watch(h.stream, record_id=record.id,
                                     prompt_tokens=h.prompt_tokens, on_fenced=fenced)
            mirrored.append(MirroredHandle(h, copy))
        record.handles = mirrored

    def detach(self, record: Record) -> None:
        """P4 ``on_disconnect=continue``: the record's requests run on without a client, also
        if this ingress dies (a replica then keeps writing their logs, not cancelling them)."""
        for h in record.handles:
            if getattr(h, "durable", False):
                h.detach = True
                self.log.detach(h.request_id)

    def load(self, record_id: str) -> Record | None:
        """Rebuild a record this ingress does not hold from the log (None if unknown)."""
        desc = self.log.get_record(record_id)
        if desc is None:
            return None
        handles: list[Any] = [LoggedHandle(LogFollower(self.log, rid), self.cancel_remote)
                              for rid in desc["handles"]]
        record = Record(record_id, desc["kind"], handles, int(desc["created"]), desc["model"],
                        spec_from_data(desc["kind"], desc["extra"]),
                        background=bool(desc["background"]))
        log.info("record rebuilt from the stream log", extra={"request_id": record_id})
        return record
