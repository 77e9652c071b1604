"""The server's choice of a durable stream log, made once when the app is built (issue 22 step
3; issue 12 items 2, 3; SPEC P3, P4, L2).

With ``--redis-url`` the app serves a :class:`~coda.durable.engine.DurableEngine` wrapping its
engine (every handle reads the durable copy of its request) and keeps its records in a
:class:`RedisResponseStore`: each stored record's descriptor (kind, model, extras, the ids of
its engine requests) goes to the log, and a record this ingress does not hold (another ingress
made it, or this server restarted) is rebuilt from it, so ``Last-Event-ID``,
``/v1/streams/{id}``, ``GET /v1/responses/{id}`` and ``previous_response_id`` work on any
ingress; the stored chat completions are listed in the log too (:mod:`coda.durable.listing`),
so ``GET /v1/chat/completions`` lists every ingress's. The routes see an :class:`~coda.engine.protocol.Engine` and a
:class:`~coda.server.state.ResponseStore`, nothing of Redis. Without a URL nothing here is
imported: the in-process engine and the in-memory store.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from coda.durable.engine import DurableEngine
from coda.durable.listing import ListedRecords
from coda.durable.redis_log import RedisStreamLog
from coda.engine.protocol import Engine, EngineHandle
from coda.server.records import Record, RecordStore
from coda.server.render_spec import OpenAIRender, spec_data, spec_from_data

log = logging.getLogger("coda.server")


class ServerDurable:
    """The settings of one server's durable log (``--redis-url``) and its lease. ``log`` is
    what a replica engine is built with (:class:`~coda.scaleout.remote.RemoteEngine`), so its
    replicas write the log themselves."""

    def __init__(self, url: str, *, retention_s: float = 600.0, lease_ttl_s: float = 10.0,
                 prefix: str = "coda:") -> None:
        self.log = RedisStreamLog(url, prefix=prefix, retention_s=retention_s,
                                  lease_ttl_s=lease_ttl_s)

    def build(self, engine: Engine, *, manage_engine: bool, capacity: int
              ) -> tuple[DurableEngine, RedisResponseStore]:
        """The engine and the store the app serves (called once, by ``create_app``)."""
        durable = DurableEngine(engine, self.log, manage_inner=manage_engine)
        return durable, RedisResponseStore(durable, capacity)


class RedisResponseStore(RecordStore):
    """A :class:`~coda.server.state.ResponseStore` whose records live in the stream log too:
    the recent ones in memory, any other rebuilt from its descriptor on first use; a response
    exists while its descriptor does (``DELETE /v1/responses/{id}`` removes it, on every front
    end at once)."""

    def __init__(self, engine: DurableEngine, capacity: int) -> None:
        super().__init__(capacity)
        self.engine = engine
        self.listed = ListedRecords(engine.log)

    def put(self, record: Record) -> None:
        self.engine.link_record(record.id, {
            "kind": record.kind, "created": record.created, "model": record.model,
            "background": record.background, "extra": spec_data(record.spec),
            "handles": [h.request_id for h in record.handles]},
            [h.request_id for h in record.handles])
        self._keep_send_s(record)
        if record.stored_chat:
            self.listed.add(record.id)
        if record.background:
            self.detach(record)
        super().put(record)

    def detach(self, record: Record) -> None:
        for h in record.handles:
            self.engine.detach(h.request_id)

    def delete(self, rid: str) -> bool:
        """The descriptor leaves the log (a restart or another front end cannot rebuild the
        record) and this process forgets it; the log decides, so of two front ends deleting
        at once one answers True. The requests' own log entries expire as they would have
        (``--log-retention-s`` after their terminal); no record reaches them any more."""
        super().delete(rid)
        self.listed.remove(rid)
        return self.engine.log.delete_record(rid)

    def stored_chats(self) -> list[Record]:
        """Every front end's ended stored chat completions, in the log's listing order
        (:mod:`coda.durable.listing`): held here, or rebuilt from the log (a rebuilt one that
        ended has its whole stream at once; one still running elsewhere is not listed yet)."""
        records = (self.get(rid) for rid in self.listed.ids())
        return [r for r in records if r is not None and r.stored_chat and r.done]

    def _current(self, record: Record) -> bool:
        """A response held here is current while its descriptor is in the log: deleted on
        any front end, it is gone here too (one ``EXISTS``; other records are never deleted).
        A stored chat completion the same, its descriptor read (one ``GET``) for the metadata
        an update on any front end wrote (coda.server.chat_store_routes)."""
        if not record.deletable:
            return True
        if not isinstance(record.spec, OpenAIRender):
            return self.engine.log.has_record(record.id)
        desc = self.engine.log.get_record(record.id)
        if desc is None:
            return False
        metadata = desc["extra"].get("metadata") or {}
        if metadata != record.spec.metadata:
            record.spec = replace(record.spec, metadata=dict(metadata))
        return True

    def _load(self, record_id: str) -> Record | None:
        desc = self.engine.log.get_record(record_id)
        if desc is None:
            return None
        handles: list[EngineHandle] = [self.engine.reopen(rid) for rid in desc["handles"]]
        record = Record(record_id, desc["kind"], handles, int(desc["created"]), desc["model"],
                        spec_from_data(desc["kind"], desc["extra"]),
                        background=bool(desc["background"]))
        self._keep_send_s(record)
        log.info("record rebuilt from the stream log", extra={"request_id": record_id})
        return record

    def _keep_send_s(self, record: Record) -> None:
        """P3, P5: the record's terminals show the first delivery's send time on every front
        end and after a restart (kept beside each request's log)."""
        ids = [h.request_id for h in record.handles]
        record.keep_send_s = lambda index, measured: self.engine.log.keep_send_s(
            ids[index], measured)
