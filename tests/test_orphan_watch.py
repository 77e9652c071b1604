"""The replica's orphan watch (SPEC P4, C1; coda.scaleout.producer.ReplicaLog): on a real
redis-server, no Ray. A running request whose ingress's lease is gone is cancelled soon after,
not a third of the lease later; a detached one runs on; a cancel recorded in the log by another
ingress reaches the request the same way."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from coda.finish import CancelCause
from coda.scaleout.producer import ORPHAN_WATCH_S, DurableSpec, ReplicaLog, _Running
from tests.redis_support import RedisServer, running_redis

pytestmark = pytest.mark.timeout(60)
LEASE_S = 30.0  # NOTE: long: a watch tied to the lease (every 10 s) misses every bound below


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


class _Stream:
    closed = False


class _Handle:
    """What the watch reads and calls: the stream's ``closed`` and ``cancel(cause)``."""

    def __init__(self) -> None:
        self.stream = _Stream()
        self.causes: list[CancelCause] = []
        self.cancelled = threading.Event()

    def cancel(self, cause: CancelCause) -> bool:
        self.causes.append(cause)
        self.stream.closed = True
        self.cancelled.set()
        return True


@contextmanager
def _replica(redis_server: RedisServer, name: str, live: str) -> Iterator[ReplicaLog]:
    """A replica's log and watch on its own prefix, with ``live``'s ingress lease held."""
    spec = DurableSpec(url=redis_server.url, prefix=f"ow-{name}:", retention_s=60.0,
                       lease_ttl_s=LEASE_S, fence="")
    replica = ReplicaLog(spec, f"replica-{name}")
    try:
        replica.log.r.set(replica.log._lease(live), "1", px=int(LEASE_S * 1000))
        yield replica
    finally:
        replica.close()


def _watch(replica: ReplicaLog, rid: str, ingress: str) -> _Handle:
    handle = _Handle()
    with replica._lock:
        replica._running[rid] = _Running(handle=handle, ingress=ingress)
    return handle


def test_p4_an_orphan_is_cancelled_within_the_watch_period_not_a_third_of_the_lease(
        redis_server: RedisServer) -> None:
    live = "ingress-live"
    with _replica(redis_server, "a", live) as replica:
        r = replica.log.r
        kept, orphan, detached = (_watch(replica, "keep", live), _watch(replica, "gone", "ingress-dead"),
                                  _watch(replica, "detached", "ingress-dead"))
        r.hset(replica.log._k("meta", "detached"), "detach", "1")
        started = time.monotonic()
        assert orphan.cancelled.wait(ORPHAN_WATCH_S * 3), "the orphan ran on past the watch"
        assert time.monotonic() - started < LEASE_S / 3
        assert orphan.causes == [CancelCause.DISCONNECT]
        time.sleep(ORPHAN_WATCH_S * 1.5)  # NOTE: another check at least; the others stay
        assert not kept.causes and not detached.causes
        assert replica.cancelled_orphans == 1


def test_c1_a_cancel_recorded_by_another_ingress_reaches_the_request_within_the_watch(
        redis_server: RedisServer) -> None:
    with _replica(redis_server, "b", "ingress-b") as replica:
        handle: Any = _watch(replica, "req", "ingress-b")
        replica.log.r.hset(replica.log._k("meta", "req"), "cancel", CancelCause.CLIENT.value)
        assert handle.cancelled.wait(ORPHAN_WATCH_S * 3)
        assert handle.causes == [CancelCause.CLIENT]
