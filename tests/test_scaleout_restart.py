"""Killed front ends with replicas (issue 12 items 3, 5; SPEC P2–P4, L2, L5, L6).

An ingress process that shares the session's replicas (conftest ``replicas``) is SIGKILLed:
its requests keep running on the live replicas, which end them exactly once (background and
``continue`` with the producer's own terminal, ``cancel`` cancelled by the replica's orphan
watch) while another ingress resumes them. Then a whole ``coda serve --replicas 2
--redis-url`` server — the ingress, its local Ray and both replicas — is SIGKILLed mid-stream
and two servers start at once on the same Redis: every request whose log had no terminal gets
exactly one (``model_error``, the durable tokens billed), written by one of the two; each stays
replayable from sequence 0 and resumable after what the client saw."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ray = pytest.importorskip("ray")

from coda.durable.redis_log import RedisStreamLog  # noqa: E402
from coda.finish import FinishReason  # noqa: E402
from coda.lifecycle import State  # noqa: E402
from coda.server.durable import ServerDurable  # noqa: E402
from coda.stream import EventType  # noqa: E402
from tests.redis_support import RedisServer, running_redis  # noqa: E402
from tests.scaleout_support import (  # noqa: E402
    FaultRow,
    free_port,
    ingress,
    kill_session,
    session_pids,
    sse_events,
    wait_for,
)

LEASE_S = 2.0  # NOTE: short, so orphans end quickly; long enough for a loaded 2-core CI box

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    yield from running_redis()


def _start(server_checkpoint: Path, url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "coda.cli", "serve", "--model", str(server_checkpoint),
         "--port", str(port), "--replicas", "2", "--redis-url", url, "--lease-ttl-s", "2",
         "--max-num-seqs", "4", "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    with httpx.Client(timeout=10) as client:
        while True:
            if proc.poll() is not None:
                raise AssertionError((proc.stderr.read() if proc.stderr else b"")[-3000:])
            try:
                if client.get(f"{base}/health").status_code == 200:
                    return proc, base
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the replica server did not start"
            time.sleep(0.5)


def test_whole_server_sigkilled_two_restarts_end_each_orphan_once_l2_l5_l6(
        server_checkpoint: Path, redis_server: RedisServer, server_spawn: Any) -> None:
    """A cancel-policy chat, a continue-policy chat and a background response run on the
    replicas when the whole server is SIGKILLed. Two servers then start at once on the same
    Redis: each orphan (a request whose log has no terminal) ends exactly once (model_error,
    usage = the durable deltas' tokens, the reapers' counts add up to the orphans); every
    request replays from 0 without gap and resumes after the client's last event on either
    server."""
    proc, url = _start(server_checkpoint, redis_server.url)
    chat = {"model": "tiny-chat", "stream": True, "ignore_eos": True, "max_tokens": 480}
    held = contextlib.ExitStack()
    try:
        with httpx.Client(timeout=60) as client, held:
            heads: dict[str, list[dict[str, str]]] = {}
            chats = []
            for policy in ("cancel", "continue"):
                # NOTE: held open until the kill: the cancel-policy client is still there
                resp = held.enter_context(client.stream("POST", f"{url}/v1/chat/completions",
                                                        json={**chat, "seed": 6,
                                                              "messages": [{"role": "user",
                                                                            "content": policy}],
                                                              "on_disconnect": policy}))
                rid = resp.headers["x-request-id"]
                lines = resp.iter_lines()
                held.callback(lines.close)  # type: ignore[attr-defined]
                heads[rid] = sse_events(resp, stop_after=3, lines=lines)
                chats.append(rid)
            bg = client.post(f"{url}/v1/responses", json={
                "model": "tiny-chat", "input": "hi", "background": True,
                "max_output_tokens": 480, "ignore_eos": True, "seed": 5}).json()["id"]
            with client.stream("GET", f"{url}/v1/responses/{bg}?stream=true") as resp:
                heads[bg] = sse_events(resp, stop_after=6)
            killed = kill_session(proc.pid)
    finally:
        killed = max(locals().get("killed", 0), kill_session(proc.pid))
        proc.wait(10)
    assert killed >= 4  # the ingress, Ray's daemons and the two replica workers
    deadline = time.monotonic() + 30
    while session_pids(proc.pid):
        assert time.monotonic() < deadline, "processes of the killed server survive"
        time.sleep(0.2)
    dlog = RedisStreamLog(redis_server.url)
    ids = [bg, *chats]
    # NOTE: the tiny model is fast: a request may have finished before the kill; the others
    # are the orphans (the one started last, the background response, practically always)
    orphans = [r for r in ids if "term" not in dlog.meta(r)]
    assert orphans
    durables = [ServerDurable(redis_server.url, lease_ttl_s=1) for _ in range(2)]
    servers = [server_spawn(durable=d) for d in durables]  # NOTE: both reap at start
    deadline = time.monotonic() + 60
    while not all("term" in dlog.meta(r) for r in ids):
        assert time.monotonic() < deadline, "an orphan was not ended"
        time.sleep(0.1)
    row = FaultRow("whole server SIGKILLed (ingress + Ray + replicas), two restarts")
    with httpx.Client(timeout=60) as client:
        for k, rid in enumerate(ids):
            evs = dlog.read(rid)
            assert [e.seq for e in evs] == list(range(len(evs)))
            term = evs[-1].terminal
            committed = sum(len(e.tokens) for e in evs if e.type is EventType.DELTA)
            assert term is not None and term.usage.selected_tokens == committed >= 1
            if rid in orphans:
                assert term.state is State.FAILED
                assert term.finish_reason is FinishReason.MODEL_ERROR
            row.add_log(evs)
            base = servers[k % 2].url
            seen = int(heads[rid][-1]["id"])
            if rid == bg:
                with client.stream("GET", f"{base}/v1/responses/{rid}",
                                   params={"stream": "true"}) as resp:
                    replay = sse_events(resp)
                with client.stream("GET", f"{base}/v1/responses/{rid}",
                                   params={"stream": "true", "starting_after": seen}) as resp:
                    rest = sse_events(resp)
                assert [int(e["id"]) for e in replay] == list(range(len(replay)))
                assert [e["data"] for e in replay[seen + 1:]] == [e["data"] for e in rest]
                ends = ("response.completed", "response.incomplete", "response.failed")
                assert sum(e["event"] in ends for e in replay) == 1
                final = client.get(f"{base}/v1/responses/{rid}").json()
                assert final["usage"]["output_tokens"] == committed
            else:
                with client.stream("GET", f"{base}/v1/streams/{rid}",
                                   headers={"Last-Event-ID": str(seen)}) as resp:
                    tail = sse_events(resp)
                got = {int(e["id"]) for e in heads[rid] + tail if "id" in e}
                assert got == set(range(len(evs)))  # every event id once, head + tail
                bodies = [json.loads(e["data"]) for e in tail if e["data"] != "[DONE]"]
                errors = [b["error"] for b in bodies if "error" in b]
                assert [e["code"] for e in errors] == (["model_error"] if rid in orphans
                                                        else [])
                assert tail[-1]["data"] == "[DONE]"
    assert sum(d.log.reaped_total for d in durables) == len(orphans)
    row.report()


def test_sigkilled_ingress_orphans_end_once_on_live_replicas_p4_l2(
        replicas: Any, redis_server: RedisServer, server_checkpoint: Path) -> None:
    """Item 3: an ingress process joins the module's Ray cluster (sharing its replicas), takes
    a background response, a continue-policy chat and a cancel-policy chat, and is SIGKILLed
    mid-stream. The replicas keep the first two running and write their own terminals into
    the log; the third is cancelled once the dead ingress's lease expired. A second ingress
    on the same Redis resumes them: every event once, exactly one terminal each, and every KV
    block free on both replicas."""
    cluster = replicas
    orphans_before = _orphans_cancelled(cluster)
    proc, url = _join_ingress(server_checkpoint, redis_server.url)
    body = {"model": cluster.model_name, "stream": True, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as client:
            wait_for(lambda: _healthy(client, url, proc), timeout=120, what="the ingress")
            bg = client.post(f"{url}/v1/responses", json={
                "model": cluster.model_name, "input": "hi", "background": True,
                "max_output_tokens": 120, "ignore_eos": True, "seed": 7}).json()["id"]
            with client.stream("GET", f"{url}/v1/responses/{bg}?stream=true") as resp:
                first = sse_events(resp, stop_after=6)
            streams = {}
            with contextlib.ExitStack() as held:
                for policy, n in (("continue", 60), ("cancel", 480)):
                    # NOTE: held open until the kill: the cancel-policy client is still there
                    resp = held.enter_context(client.stream(
                        "POST", f"{url}/v1/chat/completions", json={
                            **body, "messages": [{"role": "user", "content": policy}],
                            "max_tokens": n, "seed": 8, "on_disconnect": policy}))
                    lines = resp.iter_lines()
                    held.callback(lines.close)  # type: ignore[attr-defined]
                    streams[policy] = (resp.headers["x-request-id"],
                                       sse_events(resp, stop_after=3, lines=lines))
                watch = RedisStreamLog(redis_server.url)
                xmeta = watch.meta(streams["cancel"][0])
                assert "term" not in xmeta
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
                # NOTE: the dead ingress's lease is dropped now rather than left to expire
                # (LEASE_S): the tiny model can finish 480 tokens inside that window on a fast
                # box, and then nothing is left to cancel. Expiry itself: test_redis_log.
                watch.r.delete(watch._lease(xmeta["via"]))
            other, _ = ingress(cluster, redis_server.url, LEASE_S)
            try:
                seen = int(first[-1]["id"])
                with client.stream("GET", f"{other.url}/v1/responses/{bg}",
                                   params={"stream": "true", "starting_after": seen}) as resp:
                    rest = sse_events(resp)
                with client.stream("GET", f"{other.url}/v1/responses/{bg}",
                                   params={"stream": "true"}) as resp:
                    replay = sse_events(resp)
                crid, chead = streams["continue"]
                with client.stream("GET", f"{other.url}/v1/streams/{crid}",
                                   headers={"Last-Event-ID": chead[-1]["id"]}) as resp:
                    ctail = sse_events(resp)
                dlog = RedisStreamLog(redis_server.url)
                xrid = streams["cancel"][0]
                wait_for(lambda: "term" in dlog.meta(xrid), timeout=60,
                          what="the cancel-policy orphan's terminal")
            finally:
                other.stop()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    row = FaultRow("ingress SIGKILLed, requests on live replicas (continue/background/cancel)")
    assert [e["data"] for e in replay[seen + 1:]] == [e["data"] for e in rest]
    kinds = [e["event"] for e in replay]
    assert kinds.count("response.incomplete") == 1 and "response.failed" not in kinds
    row.add_log(dlog.read(bg))
    cevs = dlog.read(crid)
    assert ctail[-1]["data"] == "[DONE]"
    assert cevs[-1].terminal is not None
    assert cevs[-1].terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    got = sorted({int(e["id"]) for e in chead + ctail if "id" in e})
    row.add_log(cevs, got)
    xevs = dlog.read(xrid)
    assert xevs[-1].terminal is not None and xevs[-1].terminal.state is State.CANCELLED
    assert len(xevs) < 480
    row.add_log(xevs)
    row.report()
    assert _orphans_cancelled(cluster) == orphans_before + 1  # by a replica's orphan watch
    wait_for(lambda: _all_free(cluster), timeout=60, what="every KV block free (L7)")


def _join_ingress(server_checkpoint: Path, redis_url: str) -> tuple[subprocess.Popen[bytes], str]:
    """A ``coda serve`` ingress process joining this session's Ray cluster (its replicas are
    the session's: it does not own them), durable on ``redis_url``; (process, base URL). Its
    stderr goes to a temporary file (``proc.err``), never a pipe: a Ray driver receives every
    replica's log lines, and an unread pipe that fills blocks the process (its shutdown too)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
           "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0"}
    err = tempfile.TemporaryFile()  # noqa: SIM115 - outlives this call (the process writes it)
    proc = subprocess.Popen(
        [sys.executable, "-m", "coda.cli", "serve", "--model", str(server_checkpoint),
         "--port", str(port), "--replicas", "2", "--ray-address",
         ray.get_runtime_context().gcs_address, "--redis-url", redis_url,
         "--lease-ttl-s", str(LEASE_S), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=err)
    proc.err = err  # type: ignore[attr-defined]
    return proc, f"http://127.0.0.1:{port}"


def _stderr_tail(proc: subprocess.Popen[bytes]) -> str:
    err = getattr(proc, "err", None)
    if err is not None:
        err.seek(0)
        return str(err.read()[-3000:].decode(errors="replace"))
    return proc.stderr.read().decode()[-3000:] if proc.stderr else ""


def _healthy(client: httpx.Client, url: str, proc: subprocess.Popen[bytes]) -> bool:
    assert proc.poll() is None, _stderr_tail(proc)
    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.TransportError:
        return False


def _all_free(cluster: Any) -> bool:
    st = cluster.stats()
    return st.num_running == st.num_waiting == 0 and st.num_free_blocks == st.num_blocks


def _orphans_cancelled(cluster: Any) -> int:
    return sum(int(r.whoami.remote().result(timeout_s=30)["orphans_cancelled"])
               for r in cluster.replicas)


def test_sigtermed_ingress_leaves_detached_requests_running_l2_p4(
        replicas: Any, redis_server: RedisServer, server_checkpoint: Path) -> None:
    """Item 3, graceful side: an ingress sharing the replicas takes a background response and
    a ``continue``-policy chat, then gets SIGTERM. It exits cleanly without ending them: both
    run to their own terminal on the replicas (max tokens, not cancelled), and another ingress
    replays each from sequence 0 with every event once."""
    cluster = replicas
    proc, url = _join_ingress(server_checkpoint, redis_server.url)
    try:
        with httpx.Client(timeout=60) as client:
            wait_for(lambda: _healthy(client, url, proc), timeout=120, what="the ingress")
            bg = client.post(f"{url}/v1/responses", json={
                "model": cluster.model_name, "input": "hi", "background": True,
                "max_output_tokens": 300, "ignore_eos": True, "seed": 9}).json()["id"]
            with client.stream("POST", f"{url}/v1/chat/completions", json={
                    "model": cluster.model_name, "stream": True, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "go on"}], "max_tokens": 300,
                    "seed": 10, "on_disconnect": "continue"}) as resp:
                chat = resp.headers["x-request-id"]
                sse_events(resp, stop_after=3)
            proc.send_signal(signal.SIGTERM)
            # NOTE: uvicorn re-raises the signal after its graceful shutdown, and Ray's driver
            # handler turns it into exit status 15
            try:
                code = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise AssertionError(f"no exit after SIGTERM: {_stderr_tail(proc)}") from None
            assert code in (0, 15, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    dlog = RedisStreamLog(redis_server.url)
    wait_for(lambda: "term" in dlog.meta(chat), timeout=120, what="the chat's terminal")
    other, _ = ingress(cluster, redis_server.url, LEASE_S)
    try:
        with httpx.Client(timeout=60) as client, client.stream(
                "GET", f"{other.url}/v1/responses/{bg}", params={"stream": "true"}) as resp:
            replay = sse_events(resp)
    finally:
        other.stop()
    kinds = [e["event"] for e in replay]
    assert kinds.count("response.incomplete") == 1 and "response.failed" not in kinds
    row = FaultRow("ingress SIGTERMed, detached requests on live replicas")
    record = dlog.get_record(bg)
    assert record is not None
    for rid in (record["handles"][0], chat):
        evs = dlog.read(rid)
        assert evs[-1].terminal is not None
        assert evs[-1].terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
        assert sum(len(e.tokens) for e in evs if e.type is EventType.DELTA) == 300
        row.add_log(evs)
    row.report()
