"""The API records of the durable log: the descriptor that re-renders a stored response
elsewhere (``coda:rec:{id}``; issue 12 items 2, 3; SPEC P3, P4).

A record's descriptor (kind, model, extras, its engine request ids) is stored once per API
record and linked to the requests it was made of, so it expires ``retention_s`` after the last
of their terminals, like their logs (:data:`coda.durable.lua.PUT_RECORD`). A mixin of
:class:`~coda.durable.redis_log.RedisStreamLog`, like :class:`~coda.durable.reaper.Reaping`,
so callers keep one object.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["RecordStoring"]


class RecordStoring:
    """The record half of :class:`~coda.durable.redis_log.RedisStreamLog` (its keys, scripts
    and retention)."""

    r: Any
    retention_ms: int
    _put_record: Any
    _keep_send_s: Any

    def _k(self, kind: str, rid: str) -> str:
        raise NotImplementedError

    def put_record(self, record_id: str, descriptor: dict[str, Any],
                   request_ids: list[str] | tuple[str, ...] = ()) -> None:
        """Store an API record's descriptor and link ``request_ids`` to it (one script): it
        expires ``retention_s`` after the last of their terminals, whether those came before
        or after this call."""
        self._put_record(keys=[self._k("rec", record_id),
                               *(self._k("meta", rid) for rid in request_ids)],
                         args=[json.dumps(descriptor, separators=(",", ":")), record_id,
                               self.retention_ms])

    def get_record(self, record_id: str) -> dict[str, Any] | None:
        raw = self.r.get(self._k("rec", record_id))
        return None if raw is None else dict(json.loads(raw))

    def has_record(self, record_id: str) -> bool:
        return bool(self.r.exists(self._k("rec", record_id)))

    def delete_record(self, record_id: str) -> bool:
        """Remove a record's descriptor (``DELETE /v1/responses/{id}``); False if it was not
        there (deleted already, or expired)."""
        return bool(self.r.delete(self._k("rec", record_id)))

    def keep_send_s(self, request_id: str, measured: float) -> float:
        """The network send time a record renders on ``request_id``'s terminal (P3, P5): the
        first front end's ``measured`` value is kept in the request's meta hash (it expires
        with the request's log), so a replay from any front end, or after a restart, shows
        that value, not its own send. ``measured`` where the log no longer holds the request."""
        kept = self._keep_send_s(keys=[self._k("meta", request_id)], args=[repr(measured)])
        return measured if kept is None else float(kept)
