"""Shared by the replica tests (issue 12): kill a replica's actor, wait until Serve replaced it,
and count what a fault did to a stream — events lost and duplicated against the durable log,
terminals — for the fault matrix (``scripts/fault_matrix.py`` reads the rows these tests
append to ``$CODA_FAULT_REPORT``)."""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from coda.errors import ErrorCode
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.stream import EventType, StreamEvent


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sse_events(resp: Any, stop_after: int | None = None,
               lines: Iterator[str] | None = None) -> list[dict[str, str]]:
    """SSE events of the httpx response ``resp``; ``lines``: an iterator over its lines that
    the caller keeps (an abandoned iterator closes the connection: a client that left)."""
    from tests.conftest import SSEAccumulator

    acc, out = SSEAccumulator(), []
    for line in lines if lines is not None else resp.iter_lines():
        ev = acc.feed(line)
        if ev is not None:
            out.append(ev)
            if stop_after is not None and len(out) >= stop_after:
                break
    return out


def wait_for(pred: Any, timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def ingress(replicas: Any, url: str, lease_ttl_s: float) -> tuple[Any, Any]:
    """A live ingress (uvicorn on loopback) over ``replicas``' replica handles with its own
    routing state, durable on the Redis at ``url``: (LiveServer, its RemoteEngine)."""
    from coda.scaleout.remote import RemoteEngine
    from coda.server.app import create_app
    from coda.server.durable import ServerDurable
    from tests.conftest import LiveServer

    durable = ServerDurable(url, lease_ttl_s=lease_ttl_s)
    engine = RemoteEngine(replicas.replicas, replicas.config, log=durable.log)
    app = create_app(engine, manage_engine=False, durable=durable)
    return LiveServer(app).start(), engine


def kill_replica(replica: int) -> None:
    """SIGKILL-equivalent of replica ``replica``'s actor (Serve starts a new one)."""
    import ray

    for a in ray.util.list_named_actors(all_namespaces=True):
        if f"coda-replica-{replica}" in a["name"] and "REPLICA" in a["name"].upper():
            ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=False)
            return
    raise AssertionError(f"no actor for replica {replica}")


def wait_replica(handle: Any, timeout: float = 120.0) -> None:
    """Until the replica behind ``handle`` answers (Serve replaced a killed one)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            handle.whoami.remote().result(timeout_s=10)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


@dataclass
class FaultRow:
    fault: str
    streams: int = 0
    events: int = 0
    lost: int = 0
    duplicated: int = 0
    bad_terminals: int = 0

    def add_log(self, events: list[StreamEvent], received: list[int] | None = None) -> None:
        """One stream: ``events`` is its durable log, ``received`` the seqs a client got
        (None: the log itself is what the client reads). Lost = log events never received
        (or gaps in the log); duplicated = seqs received or logged twice; a stream whose
        log has not exactly one terminal, last, counts as a bad terminal."""
        seqs = [e.seq for e in events]
        self.streams += 1
        self.events += len(events)
        self.duplicated += len(seqs) - len(set(seqs))
        self.lost += (max(seqs) + 1 - len(set(seqs))) if seqs else 0
        kinds = [e.type for e in events]
        if kinds.count(EventType.TERMINAL) != 1 or kinds[-1] is not EventType.TERMINAL:
            self.bad_terminals += 1
        if received is not None:
            self.duplicated += len(received) - len(set(received))
            self.lost += len(set(seqs) - set(received))

    def report(self) -> None:
        path = os.environ.get("CODA_FAULT_REPORT")
        if path:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(asdict(self)) + "\n")
        assert self.lost == self.duplicated == self.bad_terminals == 0, asdict(self)


def session_pids(sid: int) -> list[int]:
    """Every live process of session ``sid`` (a server started with ``start_new_session``:
    the ingress, its local Ray's daemons and the replica workers)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # NOTE: state, ppid, pgrp, session
            out.append(int(entry))
    return out


def kill_session(sid: int) -> int:
    """SIGKILL every process of session ``sid`` at once (the whole server); returns how many."""
    import signal

    pids = session_pids(sid)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return len(pids)


def assert_ended_for_lost_ingress(log: Any, rid: str) -> None:
    """L5: the request an ingress (``ingress-b``, 3 prompt tokens) left unclaimed when it died,
    ended by a reaper once: no output, ``FAILED`` / ``transport_error`` naming the lost front
    end, its prompt billed (``log``: a :class:`coda.durable.redis_log.RedisStreamLog`)."""
    evs = log.read(rid)
    assert [e.type for e in evs] == [EventType.START, EventType.TERMINAL]
    term = evs[-1].terminal
    assert term is not None
    assert (term.state, term.finish_reason, term.error_code) == (
        State.FAILED, FinishReason.TRANSPORT_ERROR, ErrorCode.TRANSPORT_ERROR)
    assert "ingress-b" in (term.error_message or "") and term.usage.prompt_tokens == 3
