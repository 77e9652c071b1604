"""The records a list route shows on every ingress (``--redis-url``; SPEC P1, P3): the stored
chat completions of ``GET /v1/chat/completions``.

One key beside the stream log's (:mod:`coda.durable.redis_log`): ``listed`` (under the log's
prefix), a sorted set of record ids scored by when each was first listed, so every ingress
lists the same records in the same order (ties by id) whichever made them. A record is there
while its descriptor is (``rec:{id}``): one deleted or expired leaves the set when next listed.
"""

from __future__ import annotations

import time

from coda.durable.redis_log import RedisStreamLog


class ListedRecords:
    """The listed records of one stream log."""

    def __init__(self, log: RedisStreamLog) -> None:
        self.log = log
        self.key = f"{log.prefix}listed"

    def add(self, record_id: str) -> None:
        """List ``record_id`` from now on; its place is when it was first listed (storing it
        again, as a metadata update does, keeps it)."""
        self.log.r.zadd(self.key, {record_id: time.time()}, nx=True)

    def remove(self, record_id: str) -> None:
        self.log.r.zrem(self.key, record_id)

    def ids(self) -> list[str]:
        """The listed ids whose descriptor is still in the log, oldest first; the others
        leave the set."""
        ids = [x.decode() for x in self.log.r.zrange(self.key, 0, -1)]
        gone = {rid for rid in ids if not self.log.has_record(rid)}
        if gone:
            self.log.r.zrem(self.key, *gone)
        return [rid for rid in ids if rid not in gone]
