"""Faults under load (issue 24 item 4): the processes and the clients of
``tests/test_scaleout_faults.py``.

Front end A is a whole ``coda serve --replicas 2 --redis-url`` server (its own local Ray, the two
replicas, a per-replica ``--trace``), in its own session; front end B is a ``coda serve``
joining A's Ray cluster with ``--ray-address`` (it shares A's replicas and owns nothing).
:func:`run_load` drives N concurrent streams over both front ends — plain, ``continue``-policy,
disconnecting, cancelling, deadline-bound chats and background responses — and SIGKILLs
replica 1 and then front end B while they run. Process ids are found in ``/proc`` (the Ray
worker of a replica carries ``ServeReplica:coda-replica-<i>`` in its command line)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import SSEAccumulator
from tests.scaleout_support import free_port, session_pids

ROOT = Path(__file__).resolve().parent.parent
# NOTE: what a client does; the share of each is per ten streams (3 in 10 leave, cancel or hit
# a deadline, 1 in 10 runs on without a client and 1 in 20 is a background response)
KINDS = ("normal", "normal", "normal", "disconnect", "cancel", "deadline", "continue",
         "normal", "normal", "background")
LONG = 400  # NOTE: the leaving kinds ask for many tokens: the leave finds them running


def _env() -> dict[str, str]:
    # NOTE: Ray 2.60 starts a cluster with token authentication (the token in ~/.ray); a
    # driver joining it must be told so, as the test process's own Ray tells its children
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
            "RAY_DEDUP_LOGS": "0", "RAY_AUTH_MODE": "token"}


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class Front:
    proc: subprocess.Popen[bytes]
    url: str
    err: Any
    trace: Path | None = None  # NOTE: A's --trace (each replica writes its own file from it)

    def trace_of(self, pid: int) -> Path:
        """The ``--trace`` file the replica process ``pid`` writes."""
        assert self.trace is not None
        return self.trace.with_name(f"{self.trace.stem}.replica-{pid}{self.trace.suffix}")

    def tail(self) -> str:
        self.err.seek(0)
        return str(self.err.read()[-3000:].decode(errors="replace"))

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=10) as client:
            while True:
                assert self.proc.poll() is None, self.tail()
                try:
                    if client.get(f"{self.url}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"{self.url} did not start: {self.tail()}"
                time.sleep(0.5)


def _serve(args: list[str], new_session: bool) -> Front:
    port = free_port()
    err = tempfile.TemporaryFile()  # noqa: SIM115 - the process writes it (a pipe would fill)
    proc = subprocess.Popen([sys.executable, "-m", "coda.cli", "serve", "--port", str(port),
                             "--log-level", "warning", *args], env=_env(),
                            stdout=subprocess.DEVNULL, stderr=err,
                            start_new_session=new_session)
    return Front(proc, f"http://127.0.0.1:{port}", err)


def start_a(checkpoint: Path, redis_url: str, trace: Path, max_num_seqs: int,
            lease_s: float) -> Front:
    """The whole server: ingress A, a local Ray, two replicas writing ``trace``'s per-replica
    files (in a session of its own, so :func:`~tests.scaleout_support.kill_session` ends it)."""
    front = _serve(["--model", str(checkpoint), "--replicas", "2", "--redis-url", redis_url,
                    "--lease-ttl-s", str(lease_s), "--max-num-seqs", str(max_num_seqs),
                    "--trace", str(trace)], new_session=True)
    front.trace = trace
    return front


def gcs_address(a: Front) -> str:
    """The Ray cluster A started (its raylet's ``--gcs-address``, as Ray finds it itself)."""
    for pid in session_pids(a.proc.pid):
        for arg in _cmdline(pid).split():
            if arg.startswith("--gcs-address="):
                return arg.split("=", 1)[1]
    raise AssertionError("no raylet in A's session")


def start_b(checkpoint: Path, redis_url: str, address: str, lease_s: float) -> Front:
    return _serve(["--model", str(checkpoint), "--replicas", "2", "--ray-address", address,
                   "--redis-url", redis_url, "--lease-ttl-s", str(lease_s)], new_session=False)


def replica_pid(a: Front, index: int) -> int:
    tag = f"ServeReplica:coda-replica-{index}"
    found = [p for p in session_pids(a.proc.pid) if tag in _cmdline(p)]
    assert len(found) == 1, (tag, found)
    return found[0]


def wait_replica_back(a: Front, index: int, old: int, timeout: float = 180.0) -> int:
    """Until Serve replaced replica ``index`` (pid ``old``) and A answers through both."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=30) as client:
        while True:
            pids = [p for p in session_pids(a.proc.pid)
                    if f"ServeReplica:coda-replica-{index}" in _cmdline(p) and p != old]
            try:
                if pids and client.get(f"{a.url}/health").status_code == 200:
                    return pids[0]
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the killed replica did not come back"
            time.sleep(0.5)


@dataclass
class Stream:
    """One client: what it asked, where, and every SSE event it received."""

    i: int
    kind: str
    front: str  # NOTE: "A" or "B"
    max_tokens: int
    rid: str | None = None  # NOTE: the chat's request id, or the response's id
    got: list[dict[str, str]] = field(default_factory=list)
    complete: bool = False  # NOTE: the stream's final event arrived
    cut: bool = False  # NOTE: the connection broke (its front end was killed)

    @property
    def policy(self) -> str:
        return "continue" if self.kind in ("continue", "background") else "cancel"


def plan(n: int, seed: int) -> list[Stream]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        tokens = LONG if kind in ("disconnect", "cancel", "deadline") else rng.randint(16, 48)
        out.append(Stream(i, kind, "AB"[(i // len(KINDS)) % 2], tokens))
    return out


async def _run_one(client: httpx.AsyncClient, base: str, model: str, s: Stream) -> None:
    acc = SSEAccumulator()
    try:
        if s.kind == "background":
            made = await client.post(f"{base}/v1/responses", json={
                "model": model, "input": f"s{s.i}", "background": True, "ignore_eos": True,
                "max_output_tokens": s.max_tokens, "seed": s.i})
            s.rid = made.json()["id"]
            call = client.stream("GET", f"{base}/v1/responses/{s.rid}",
                                 params={"stream": "true"})
        else:
            body: dict[str, Any] = {
                "model": model, "stream": True, "ignore_eos": True, "seed": s.i,
                "max_tokens": s.max_tokens,
                "messages": [{"role": "user", "content": f"stream {s.i}"}]}
            if s.kind == "continue":
                body["on_disconnect"] = "continue"
            if s.kind == "deadline":
                body["deadline"] = 0.3
            call = client.stream("POST", f"{base}/v1/chat/completions", json=body)
        async with call as resp:
            if s.rid is None:
                s.rid = resp.headers["x-request-id"]
            async for line in resp.aiter_lines():
                ev = acc.feed(line)
                if ev is None:
                    continue
                s.got.append(ev)
                if s.kind == "disconnect" and len(s.got) >= 2:
                    return  # NOTE: leaves: the connection closes unread (P4 cancel)
                if s.kind == "cancel" and len(s.got) == 2:
                    await client.post(f"{base}/v1/requests/{s.rid}/cancel")
                if ev.get("data") == "[DONE]" or ev.get("event") in (
                        "response.completed", "response.incomplete", "response.failed"):
                    s.complete = True
    except (httpx.TransportError, KeyError, ValueError):
        s.cut = True  # NOTE: the front end died under it (or before it answered)


def start_late(base: str, model: str, first: int, k: int) -> tuple[list[Stream], Any]:
    """``k`` long cancel-policy chats on ``base`` (front end B), started just before its
    kill, so that it always holds some (P4: B's own load may all have ended by then): their
    streams and the thread reading them (it ends when B dies)."""
    late = [Stream(first + j, "late", "B", LONG) for j in range(k)]

    async def read_all() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=60)) as client:
            await asyncio.gather(*(_run_one(client, base, model, s) for s in late))

    reader = threading.Thread(target=asyncio.run, args=(read_all(),), daemon=True)
    reader.start()
    return late, reader


# NOTE: when the faults strike, as the share of streams ended. Early, while the queues are
# deep: on a quiet machine the whole CI load drains in ~4 s, and at 30% / 55% replica 1 held
# nothing queued (no retry to see, O2) and B nothing running on replica 0 (no orphan to cancel)
KILL_REPLICA_AT, KILL_B_AT = 0.15, 0.35


async def run_load(streams: list[Stream], urls: dict[str, str], model: str,
                   kill_replica: Any, kill_b: Any) -> None:
    """Every stream at once; ``kill_replica()`` once :data:`KILL_REPLICA_AT` of them ended,
    ``kill_b()`` once :data:`KILL_B_AT` did (both blocking: run in a thread)."""
    ended = 0

    async def one(s: Stream) -> None:
        nonlocal ended
        try:
            await _run_one(client, urls[s.front], model, s)
        finally:
            ended += 1

    async def faults() -> None:
        for share, act in ((KILL_REPLICA_AT, kill_replica), (KILL_B_AT, kill_b)):
            while ended < share * len(streams):
                await asyncio.sleep(0.05)
            await asyncio.to_thread(act)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    # NOTE: a stream that stops moving for 2 minutes is cut (then its resume fails the test)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120, connect=60), limits=limits) as client:
        await asyncio.gather(faults(), *(one(s) for s in streams))


@dataclass
class TraceView:
    """What a replica's ``--trace`` file shows so far (flushed per row; a row cut mid-write
    is skipped): the requests routed to it, started there, ended there, and those routed to it
    as a retry after another replica failed (O2)."""

    routed: set[str] = field(default_factory=set)
    started: set[str] = field(default_factory=set)
    ended: set[str] = field(default_factory=set)
    retried: set[str] = field(default_factory=set)

    @classmethod
    def read(cls, path: Path) -> TraceView:
        view = cls()
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError:
            return view
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            rid, kind = row.get("request_id"), row.get("kind")
            if kind == "route.decided":
                view.routed.add(rid)
                if row.get("reason") == "retry_after_failure":
                    view.retried.add(rid)
            elif kind == "prefill.started":
                view.started.add(rid)
            elif kind == "terminal":
                view.ended.add(rid)
        return view

    @property
    def queued(self) -> set[str]:
        return self.routed - self.started - self.ended

    @property
    def open(self) -> set[str]:
        return self.routed - self.ended


def wait_until(check: Any, timeout: float, every: float = 0.02) -> bool:
    """Poll ``check()`` every ``every`` s until it is true or ``timeout`` passed; its last
    value."""
    deadline = time.monotonic() + timeout
    while not (ok := bool(check())) and time.monotonic() < deadline:
        time.sleep(every)
    return ok


def kill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
