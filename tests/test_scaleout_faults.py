"""Faults under load (issue 24 item 4; SPEC P2, P3, P4, L2, L5, L6, L7, O2).

N concurrent streams over two replicas with the Redis log, through two front ends: A, a whole
``coda serve --replicas 2 --redis-url`` server, and B, a ``coda serve`` that joined A's Ray
cluster with ``--ray-address`` (:mod:`tests.fault_load`). 3 in 10 clients leave early,
cancel or hit a deadline, 1 in 10 runs on without a client (``on_disconnect=continue``) and 1
in 20 is a background response. Once 15% of the streams ended and replica 1's trace shows
requests queued there, replica 1 is SIGKILLed; once 35% ended and that failure settled (each
request replica 1 held retried or ended), front end B is, and its lease is deleted right after
(NOTE: so its orphans' fate does not depend on how long the tiny model takes versus
``--lease-ttl-s``; lease expiry itself is tested in test_redis_log). Then:

- every request ends exactly once: one terminal, last, in the log; nothing left open (P2, L2);
- every stream resumes on the surviving front end A from a random sequence number with exactly
  the log's events after it, its text equal to the log's (P3); a client whose connection was
  cut resumes after what it saw: 0 lost, 0 duplicated;
- B's orphans follow their policy: ``continue`` and background ones are never cancelled,
  ``cancel`` ones are cancelled (one that finished first is not); three long chats started
  on B just before its kill (opened in the log, claimed by a replica or not yet) end
  ``CANCELLED`` / ``transport_error`` if still running when B died (at least one is),
  whichever of a reaper and the replica's orphan watch ends them (P4, L5);
- every KV block is free on both replicas and nothing runs (L7);
- every replica's ``--trace`` file but the killed process's passes ``coda trace check``, each
  request in it carries its ``route.decided`` row, some of them retries after the kill (O2);
- over 3 repeats or more (``scripts/fault_matrix.py --streams 1000``), the RSS of A and of
  replica 0 grows ≤ 5% from repeat 2 to 3.

CI runs 120 streams, 1 repeat (about 90 s on the loaded 2-core development box, half of it
starting the two front ends), leases of 12 s; ``CODA_FAULT_STREAMS`` / ``CODA_FAULT_REPEATS``
size it (``scripts/fault_matrix.py --streams 1000`` runs 1,000 × 3 repeats, leases of 60 s:
see ``LEASE_S``)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("ray")

from coda.durable.redis_log import RedisStreamLog  # noqa: E402
from coda.lifecycle import State  # noqa: E402
from coda.stream import EventType, StreamEvent  # noqa: E402
from coda.trace import ROUTE_DECIDED, read_jsonl  # noqa: E402
from tests import fault_load as fl  # noqa: E402
from tests.redis_support import RedisServer, running_redis  # noqa: E402
from tests.scaleout_support import FaultRow, kill_session, sse_events, wait_for  # noqa: E402

STREAMS = int(os.environ.get("CODA_FAULT_STREAMS", "120"))
REPEATS = int(os.environ.get("CODA_FAULT_REPEATS", "1"))
# NOTE: the lease must outlast the longest gap a live process's heartbeat sees. At 1,000
# streams on the shared 2 cores, 2 s and 10 s leases of live front ends and replicas lapsed
# (every owner's at once; cause not established: Redis blocked on its AOF, or the heartbeat
# thread, which also runs the reaper, delayed) and their running requests were reaped
# (test_fenced_live_replica_forwards_the_peers_terminal_l2_l5 covers that fault; what is
# still wrong then is in docs/scale-out.md). Hence 60 s at full size; 6 s at the CI size, so
# B's cancel-policy orphans are cancelled soon after the kill (B's lease is deleted; the
# replicas' orphan watch runs every second, coda.scaleout.producer.ORPHAN_WATCH_S) while a live
# lease survives a loaded machine's heartbeat gaps (at 2 s, a run beside other jobs saw live
# leases lapse: orphans FAILED; at 6 s the same once with the suite on two workers, another
# test file's model beside it: 12 s; the watch ran every lease / 3 then, and at 12 s B's two
# cancel-policy orphans once finished in the 4 s before it looked). Still load-sensitive: on a
# busy machine B's short chats can all end before its kill (orphans 0; docs/scale-out.md).
LEASE_S = float(os.environ.get("CODA_FAULT_LEASE_S", "12" if STREAMS <= 200 else "60"))

pytestmark = pytest.mark.timeout(600 + 400 * REPEATS * max(1, STREAMS // 250))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _seq(ev: dict[str, str]) -> int | None:
    """The log seq of an SSE event: a group's last frame carries the plain seq (earlier
    frames of the group ``seq.k``, not counted, so a seq is received once per group); the
    footer's ``[DONE]`` repeats the terminal's id and is not an event of the log."""
    sid = ev.get("id", "")
    if not sid or "." in sid or ev.get("data") == "[DONE]":
        return None
    return int(sid)


def _text(events: list[dict[str, str]]) -> str:
    out = []
    for e in events:
        if e.get("data", "[DONE]") == "[DONE]":
            continue
        for choice in json.loads(e["data"]).get("choices", []):
            out.append(choice.get("delta", {}).get("content") or "")
    return "".join(out)


def _log_text(evs: list[StreamEvent]) -> str:
    return "".join(e.data.decode() for e in evs if e.type is EventType.DELTA)


def _tail(client: httpx.Client, base: str, rid: str, after: int) -> list[dict[str, str]]:
    headers = {"Last-Event-ID": str(after)} if after >= 0 else {}
    with client.stream("GET", f"{base}/v1/streams/{rid}", headers=headers) as resp:
        assert resp.status_code == 200, (rid, resp.read())
        return sse_events(resp)


def _metric(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _idle(client: httpx.Client, a: fl.Front) -> bool:
    """Nothing running or waiting on the replicas, every KV block free (A's /health and
    /metrics sum and max them over both replicas)."""
    assert a.proc.poll() is None, a.tail()
    try:
        h = client.get(f"{a.url}/health").json()
        used = _metric(client.get(f"{a.url}/metrics").text, "coda:kv_cache_usage_perc")
    except (httpx.TransportError, ValueError):  # NOTE: replica 1 may still be restarting
        return False
    return bool(h.get("num_running") == h.get("num_waiting") == 0 and used == 0)


def _repeat(n: int, ckpt: Path, redis: RedisServer, a: fl.Front, address: str,
            model: str, killed: list[int], rng: random.Random) -> dict[str, Any]:
    """One run of the load with its two kills, then every check; its counts."""
    dlog = RedisStreamLog(redis.url)
    b = fl.start_b(ckpt, redis.url, address, LEASE_S)
    b.wait_healthy()
    streams = fl.plan(STREAMS, seed=n)
    orphans: set[str] = set()
    old = fl.replica_pid(a, 1)
    at_kill: dict[str, Any] = {"queued": 0, "open": set()}

    def kill_replica() -> None:
        # NOTE: with requests queued on it, so the kill makes retries (O2); should none come
        # (a loaded machine dispatched them all), the kill proceeds and the counts say so
        fl.wait_until(lambda: len(fl.TraceView.read(a.trace_of(old)).queued) >= 2, 10)
        view = fl.TraceView.read(a.trace_of(old))
        fl.kill(old)
        killed.append(old)
        at_kill.update(queued=len(view.queued), open=view.open)

    def settled() -> bool:
        """Every request open on the killed replica was retried on replica 0 or ended."""
        retried = fl.TraceView.read(a.trace_of(fl.replica_pid(a, 0))).retried
        return all(r in retried or "term" in dlog.meta(r) for r in at_kill["open"])

    def kill_b() -> None:
        # NOTE: once the replica's failure settled: B's own requests on it were retried or
        # ended by B, not left to the reaper because B died before it noticed (under load
        # B's traffic can reach the replicas seconds after A's)
        fl.wait_until(settled, 60, every=0.25)  # NOTE: each poll parses a whole trace file
        # NOTE: P4 needs B to hold cancel-policy requests when it dies: three long chats,
        # killed once B opened each in the log (claimed by a replica or not yet: either way
        # they end CANCELLED, by the replica's orphan watch or by a reaper)
        late, reader = fl.start_late(b.url, model, STREAMS, 3)
        assert fl.wait_until(lambda: all(s.rid and "owner" in dlog.meta(s.rid) for s in late),
                             60, every=0.05), "B did not open its late chats in the log"
        b.proc.kill()
        b.proc.wait(30)
        # NOTE: B's orphans are its requests without a terminal now, while its lease still
        # holds: read after the lease is gone, a reaper or a replica's orphan watch may have
        # ended some already (the late chats too: then none was counted, and the P4 check
        # below saw only B's own short chats, which may all finish first)
        mine = [s.rid for s in streams + late if s.front == "B" and s.rid]
        orphans.update(r for r in mine if "term" not in dlog.meta(_log_rid(dlog, r)))
        reader.join(60)
        streams.extend(late)
        # NOTE: B's server id from the requests it opened (meta ``ingress``), not from eight
        # of its chats' ``via or owner``: one B took back from the killed replica and ended
        # names that replica there, and had all eight been such, B's lease was left to lapse
        # (12 s) while its orphans ran on
        for server in {dlog.meta(s.rid or "").get("ingress") for s in late} - {None}:
            dlog.r.delete(dlog._lease(str(server)))  # NOTE: see the module docstring

    try:
        asyncio.run(fl.run_load(streams, {"A": a.url, "B": b.url}, model, kill_replica, kill_b))
    finally:
        if b.proc.poll() is None:
            b.proc.kill()
            b.proc.wait(30)
    rids = {s.rid: _log_rid(dlog, s.rid) for s in streams if s.rid}
    wait_for(lambda: all("term" in dlog.meta(r) for r in rids.values()), timeout=180,
             what="a terminal for every request")
    wait_for(lambda: dlog.r.scard(dlog._open) == 0, timeout=60, what="no open request")
    row = FaultRow(f"{STREAMS} streams, 2 replicas + Redis, 30% leave/cancel/deadline, "
                   f"replica and front end SIGKILLed (repeat {n + 1})")
    states: dict[str, list[State]] = {}
    ends: dict[str, list[str]] = {}  # NOTE: state/finish_reason per client kind, reported
    problems: list[dict[str, Any]] = []  # NOTE: every failed check, reported, then asserted
    with httpx.Client(timeout=30) as client:
        for s in streams:
            if s.rid is None:
                continue  # NOTE: B died before answering; the open-set check covers it
            evs = dlog.read(rids[s.rid])
            term = evs[-1].terminal if evs else None
            assert term is not None, s
            states.setdefault(f"{s.front}:{s.kind}", []).append(term.state)
            ends.setdefault(f"{s.front}:{s.kind}", []).append(
                f"{term.state.value}/{term.finish_reason.value}")
            if s.rid in orphans and s.policy == "cancel":
                states.setdefault("orphan:cancel", []).append(term.state)
            try:
                if s.kind == "background":
                    _check_background(client, a.url, s, evs, rng, row)
                else:
                    _check_chat(client, a.url, s, evs, rng, row)
            except (AssertionError, httpx.TransportError) as exc:
                problems.append({"stream": s.i, "front": s.front, "kind": s.kind,
                                 "problem": str(exc)[-400:], "meta": dlog.meta(rids[s.rid]),
                                 "log_end": term.error_message})
        wait_for(lambda: _idle(client, a), timeout=180, what="every KV block free (L7)")
    summary = {"streams": row.streams, "events": row.events, "lost": row.lost,
               "duplicated": row.duplicated, "bad_terminals": row.bad_terminals,
               "orphans": len(orphans), "problems": len(problems),
               "orphans_cancelled": states.get("orphan:cancel", []).count(State.CANCELLED),
               "ends": {k: {x: v.count(x) for x in sorted(set(v))} for k, v in ends.items()},
               # NOTE: who ended B's late chats: a replica that had claimed them (its watch)
               # or a reaper (B still owned them: the submit had not been claimed)
               # NOTE: B's late chats still running when it died (under load one can finish
               # its 400 tokens before B answered for the last of them)
               "late_open_at_kill": sorted(f"{s.i}" for s in streams
                                           if s.kind == "late" and s.rid in orphans),
               "late_ended_by": sorted("replica" if dlog.meta(s.rid or "")["owner"].startswith(
                   "replica-") else "reaper" for s in streams if s.kind == "late")}
    print(json.dumps(summary), flush=True)  # NOTE: shown with -s, whatever fails below
    if problems:
        _report({**summary, "first_problems": problems[:8]})
    assert not problems, problems[:8]
    row.report()
    # NOTE: P4 on B's orphans: those of its three late chats still running when it died
    # (at least one) end CANCELLED (transport_error: the client's connection died with B);
    # one that finished first is not an orphan, nor are its own load's short chats that
    # ended first (docs/scale-out.md)
    late_ends = [f"{t.state.value}/{t.finish_reason.value}" for s in streams
                 if s.kind == "late" and s.rid in orphans
                 and (t := dlog.read(s.rid)[-1].terminal) is not None]
    assert late_ends and set(late_ends) == {"CANCELLED/transport_error"}, (late_ends, ends)
    assert State.CANCELLED in states["orphan:cancel"], states
    assert State.CANCELLED in states.get("A:disconnect", []) + states.get("B:disconnect", [])
    summary["retries"], summary["queued_at_kill"] = _check_traces(a, killed), at_kill["queued"]
    fl.wait_replica_back(a, 1, old)
    return summary


def _report(load: dict[str, Any]) -> None:
    if os.environ.get("CODA_FAULT_REPORT"):  # NOTE: scripts/fault_matrix.py prints it
        with open(os.environ["CODA_FAULT_REPORT"], "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"load": load}) + "\n")


def _check_chat(client: httpx.Client, base: str, s: fl.Stream, evs: list[StreamEvent],
                rng: random.Random, row: FaultRow) -> None:
    """Resume on ``base`` from a random seq: exactly the log's events after it, and its text;
    what the client received, completed by a resume after its last event if it was cut, is
    every event of the log once; a ``continue`` request is never cancelled."""
    pick = rng.randint(-1, len(evs) - 1)
    tail = _tail(client, base, str(s.rid), pick)
    assert [_seq(e) for e in tail if _seq(e) is not None] == \
        list(range(pick + 1, len(evs))), (s, pick)
    assert _text(tail) == _log_text(evs[pick + 1:]), s
    seen = [q for q in map(_seq, s.got) if q is not None]
    if not s.complete:
        last = max(seen, default=-1)
        seen += [q for q in map(_seq, _tail(client, base, str(s.rid), last)) if q is not None]
    row.add_log(evs, seen)
    term = evs[-1].terminal
    if s.policy == "continue":
        assert term is not None and term.state is not State.CANCELLED, s


def _log_rid(dlog: RedisStreamLog, rid: str) -> str:
    """A response's engine request id (its record's one handle), else ``rid`` itself."""
    if rid.startswith("resp"):
        rec = dlog.get_record(rid)
        assert rec is not None, rid
        return str(rec["handles"][0])
    return rid


def _check_background(client: httpx.Client, base: str, s: fl.Stream, evs: list[StreamEvent],
                      rng: random.Random, row: FaultRow) -> None:
    with client.stream("GET", f"{base}/v1/responses/{s.rid}", params={"stream": "true"}) as r:
        replay = sse_events(r)
    ends = ("response.completed", "response.incomplete", "response.failed")
    assert sum(e["event"] in ends for e in replay) == 1, s
    assert evs[-1].terminal is not None and evs[-1].terminal.state is not State.CANCELLED
    pick = rng.randint(0, len(replay) - 1)
    with client.stream("GET", f"{base}/v1/responses/{s.rid}",
                       params={"stream": "true", "starting_after": pick}) as r:
        rest = sse_events(r)
    assert [e["data"] for e in rest] == [e["data"] for e in replay[pick + 1:]], s
    head = [e["data"] for e in s.got]
    assert head == [e["data"] for e in replay[:len(head)]], s  # NOTE: the client's prefix
    row.add_log(evs)


def _check_traces(a: fl.Front, killed: list[int]) -> int:
    """``coda trace check`` on every replica's trace file except the SIGKILLed processes'
    (their last requests end mid-trace there; whole in the replica that took them over).
    Returns how many decisions were retries after the failure."""
    assert a.trace is not None
    files = sorted(a.trace.parent.glob(f"{a.trace.stem}.replica-*{a.trace.suffix}"))
    kept = [f for f in files if not any(f".replica-{pid}." in f.name for pid in killed)]
    assert kept and len(kept) == len(files) - len(killed), (files, killed)
    retries = 0
    for f in kept:
        done = subprocess.run([sys.executable, "-m", "coda.cli", "trace", "check", str(f)],
                              cwd=fl.ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:]
        rows = read_jsonl(f)
        routes = [e for e in rows if e.kind == ROUTE_DECIDED]
        assert {e.request_id for e in routes} == {e.request_id for e in rows}
        assert len(routes) == len({e.request_id for e in routes})  # one decision per replica
        retries += sum(e.data["reason"] == "retry_after_failure" for e in routes)
    return retries


def test_faults_under_load_every_stream_once_p2_p3_p4_l2_l7_o2(
        server_checkpoint: Path, redis_server: RedisServer, tmp_path: Path) -> None:
    """See the module docstring; CI size: 120 streams, 1 repeat."""
    trace = tmp_path / "trace.jsonl"
    a = fl.start_a(server_checkpoint, redis_server.url, trace, max_num_seqs=8, lease_s=LEASE_S)
    killed: list[int] = []
    rng = random.Random(24)
    results = []
    try:
        a.wait_healthy()
        model = httpx.get(f"{a.url}/health", timeout=30).json()["model"]
        address = fl.gcs_address(a)
        for n in range(REPEATS):
            results.append(_repeat(n, server_checkpoint, redis_server, a, address, model,
                                   killed, rng))
            results[-1]["rss_kib"] = {"A": fl.rss_kib(a.proc.pid),
                                      "replica0": fl.rss_kib(fl.replica_pid(a, 0))}
            print(json.dumps(results[-1]), flush=True)
            _report(results[-1])
    finally:
        kill_session(a.proc.pid)
        a.proc.wait(30)
    # NOTE: the kill hit queued requests: their ingress retried them on replica 0 (O2 rows)
    assert sum(r["retries"] for r in results) >= 1, results
    if REPEATS >= 3:
        for who in ("A", "replica0"):
            two, three = results[1]["rss_kib"][who], results[2]["rss_kib"][who]
            assert three <= two * 1.05, (who, [r["rss_kib"] for r in results])
