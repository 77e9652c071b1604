"""What a front end adopts from the shared Redis is data, never code, and a meta no server
wrote never stops its reaper (SPEC P4, L2, L5; :mod:`coda.scaleout.adopt`, docs/scale-out.md
"Trust boundary"). Real ``redis-server``, no Ray: the adopter is the product's
:class:`~coda.scaleout.adopt.Adopter` over a stand-in for the front end's engine that records
what it is asked to run.

Found by review: the ingress stored the request it sends a replica as a pickle in the request's
meta (``req``), and an adopting front end ran ``pickle.loads`` on it, so whoever could write to
that Redis ran code in every front end with replicas. And a meta value that is not UTF-8
(``model``) or not a number (``prompt``) raised out of the reaper, which ended the heartbeat
thread: the front end's lease then lapsed and its peers ended its live requests."""

from __future__ import annotations

import os
import pickle
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coda.durable.redis_log import RedisStreamLog
from coda.durable.request_codec import encode_stored
from coda.engine.types import GenerationRequest
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.sampling import SamplingParams
from coda.scaleout.adopt import Adopter, open_routed
from coda.stream import RequestStream
from tests.redis_support import RedisServer, running_redis
from tests.scaleout_support import assert_ended_for_lost_ingress

pytestmark = pytest.mark.timeout(120)
LEASE_S = 0.6  # NOTE: the heartbeat (and its reaper) runs every 0.2 s


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


class _Engine:
    """The adopting front end's engine, as :class:`Adopter` uses it: its log, its model, and
    ``submit_adopted``, which records the request and ends it at once."""

    def __init__(self, log: RedisStreamLog) -> None:
        self.log, self.model_name = log, "m"
        self.adopted: list[GenerationRequest] = []
        self.lock = threading.Lock()

    def submit_adopted(self, req: GenerationRequest) -> Any:
        with self.lock:
            self.adopted.append(req)
        stream = RequestStream(req.request_id or "")
        stream.start("m")
        stream.close(Terminal(State.FINISHED, FinishReason.MAX_OUTPUT_TOKENS, Usage()))
        return type("Handle", (), {"stream": stream})()


class _Payload:
    """A pickle that runs code when loaded (makes directory ``marker``)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.mkdir, (str(self.marker),)


def _logs(url: str, *names: str) -> list[RedisStreamLog]:
    prefix = f"untrusted{uuid.uuid4().hex[:6]}:"
    logs = [RedisStreamLog(url, prefix=prefix, lease_ttl_s=LEASE_S, server_id=n) for n in names]
    for log in logs:
        log.fence = str(log.r.incr(f"{prefix}fence"))
        log.heartbeat()
    return logs


def _adopter(log: RedisStreamLog) -> _Engine:
    engine = _Engine(log)
    log.adopter = Adopter(engine)  # type: ignore[arg-type]  # NOTE: the engine's stand-in
    return engine


def _orphan(b: RedisStreamLog, request: bytes, model: str = "m") -> str:
    """A detached request B opened for a replica with ``request`` stored, then B SIGKILLed."""
    rid = uuid.uuid4().hex
    b.open(rid, prompt_tokens=3, detached=True, ingress=True, request=request, model=model)
    b.r.delete(b._lease(b.server_id))
    return rid



def _planted(marker: Path) -> dict[str, bytes]:
    body = encode_stored(GenerationRequest((1, 2, 3)), time.time())
    return {"malicious pickle": pickle.dumps(_Payload(marker)),
            "another version": body.replace(b'"v":1', b'"v":2'),
            "wrong types": body.replace(b'"prompt_token_ids":[1,2,3]',
                                        b'"prompt_token_ids":"1,2,3"')}


@pytest.mark.parametrize("kind", ["malicious pickle", "another version", "wrong types"])
def test_a_stored_request_an_adopter_cannot_read_is_refused_and_ends_transport_error_l5(
        redis_server: RedisServer, tmp_path: Path, kind: str) -> None:
    """P4, L5, L2: a detached orphan whose stored request is not this codec's (planted in the
    shared Redis) is not adopted and nothing of it runs (before the fix a pickle's payload
    ran: the marker directory appeared); it waits out the grace for a front end that reads
    it, then ends once ``FAILED`` / ``transport_error`` naming B, as one with nothing stored."""
    marker = tmp_path / "ran"
    b, a = _logs(redis_server.url, "ingress-b", "ingress-a")
    engine = _adopter(a)
    a.adopt_grace_ms = 300
    rid = _orphan(b, _planted(marker)[kind])
    assert a.reap_orphans() == 0
    assert not marker.exists(), "the stored request's pickle ran in the adopter"
    assert engine.adopted == [] and a.adopted_total == 0 and "adopted" not in a.meta(rid)
    assert "term" not in a.meta(rid)  # NOTE: within the grace
    time.sleep(0.4)
    assert a.reap_orphans() == 1
    assert_ended_for_lost_ingress(a, rid)
    assert not marker.exists() and engine.adopted == []


def test_a_stored_request_is_adopted_as_it_was_asked_p4(redis_server: RedisServer) -> None:
    """P4: what the ingress stored (:func:`~coda.scaleout.adopt.open_routed`, the product's)
    is what the adopter runs: every field, the deadline cut by the time since."""
    b, a = _logs(redis_server.url, "ingress-b", "ingress-a")
    engine = _adopter(a)
    req = GenerationRequest((5, 6, 7), SamplingParams(temperature=0.7, seed=4), max_tokens=9,
                            stop=("x",), deadline_s=30.0, request_id=uuid.uuid4().hex)
    open_routed(b, req, True, "m")
    b.r.delete(b._lease(b.server_id))
    assert a.reap_orphans() == 0 and a.adopted_total == 1
    assert a.meta(req.request_id or "")["adopted"] == "ingress-b"
    deadline = time.monotonic() + 10
    while not engine.adopted and time.monotonic() < deadline:
        time.sleep(0.01)
    [got] = engine.adopted
    assert got.deadline_s is not None and 25.0 < got.deadline_s <= 30.0
    assert got == GenerationRequest(req.prompt_token_ids, req.sampling, max_tokens=9,
                                    stop=("x",), deadline_s=got.deadline_s,
                                    request_id=req.request_id)


def test_a_meta_no_server_wrote_does_not_stop_the_heartbeat_l2(
        redis_server: RedisServer) -> None:
    """L2 (this front end's own requests are never ended as if it had died): orphans planted
    with a ``model`` that is not UTF-8 and a ``prompt`` that is not a number are skipped by
    the reaper (the first refused, then ended ``transport_error`` after its grace), the
    orphan beside them is ended, and the heartbeat runs on, its lease alive. Before the fix
    the first raised out of the reaper and ended the heartbeat thread with it."""
    b, a = _logs(redis_server.url, "ingress-b", "ingress-a")
    _adopter(a)
    a.adopt_grace_ms = 300
    body = encode_stored(GenerationRequest((1, 2, 3)), time.time())
    bad_model = _orphan(b, body, model="m")
    b.r.hset(b._k("meta", bad_model), "model", b"\xff\xfe")
    bad_prompt = uuid.uuid4().hex
    b.open(bad_prompt, prompt_tokens=3, ingress=True)
    b.r.hset(b._k("meta", bad_prompt), "prompt", b"three")
    plain = uuid.uuid4().hex
    b.open(plain, prompt_tokens=3, ingress=True)
    b.r.delete(b._lease(b.server_id))
    a.start()
    try:
        deadline = time.monotonic() + 20
        while not (a.r.hexists(a._k("meta", plain), "term")  # NOTE: meta() decodes UTF-8
                   and a.r.hexists(a._k("meta", bad_model), "term")) and (
                time.monotonic() < deadline):
            time.sleep(0.05)
        time.sleep(3 * LEASE_S)  # NOTE: the poisoned one is met again every round
        assert a._thread is not None and a._thread.is_alive(), "the heartbeat thread died"
        assert a.r.get(a._lease(a.server_id)) == a.fence.encode()
        assert a.read(plain)[-1].terminal is not None
        assert a.read(plain)[-1].terminal.state is State.CANCELLED  # type: ignore[union-attr]
        assert_ended_for_lost_ingress(a, bad_model)
        assert "term" not in a.meta(bad_prompt)  # NOTE: logged and left, never guessed
    finally:
        a.stop(release=True)
