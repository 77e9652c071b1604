"""Cost of the durable stream log per token (issue 12 item 6): the Redis Streams log against the
in-memory log of one process, in the same run. Prints figures only (no asserts on time).

Run: ``python benchmarks/bench_stream_log.py`` (starts a throwaway ``redis-server`` on loopback
with AOF ``appendfsync everysec``; ``--redis-url`` uses an existing one). One token per delta,
as the engine emits them. Three writers of the same events:

* ``in-memory`` — :meth:`coda.stream.RequestStream.delta` (today's log);
* ``redis-1``   — one Lua append per event, one round trip each (a writer that never batches);
* ``redis-mirror`` — :class:`coda.durable.mirror.LogMirror` as the server runs it: ``--streams``
  concurrent streams, a writer thread pipelining whatever accumulated since its last round trip.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import tempfile
import time
import uuid

from coda.durable.mirror import LogMirror
from coda.durable.redis_log import RedisStreamLog
from coda.stream import BackpressureConfig, EventType, RequestStream, StreamEvent, TokenInfo

_BIG = BackpressureConfig(pause_bytes=1 << 40, max_bytes=1 << 40)


def _start_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = tempfile.mkdtemp(prefix="coda-bench-redis-")
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found (apt-get install redis-server)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", d,
                             "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
                            stdout=subprocess.DEVNULL)
    return proc, f"redis://127.0.0.1:{port}/0", d


def in_memory(tokens: int) -> float:
    s = RequestStream("m", _BIG)
    s.start("m")
    t0 = time.perf_counter()
    for i in range(tokens):
        s.delta(b"x", (TokenInfo(i),))
    return (time.perf_counter() - t0) / tokens


def redis_one(log: RedisStreamLog, tokens: int) -> float:
    rid = uuid.uuid4().hex
    log.open(rid, prompt_tokens=1)
    log.append(StreamEvent(rid, 0, EventType.START, model="m"))
    t0 = time.perf_counter()
    for i in range(tokens):
        log.append(StreamEvent(rid, i + 1, EventType.DELTA, b"x", (TokenInfo(i),)))
    return (time.perf_counter() - t0) / tokens


def redis_mirror(log: RedisStreamLog, tokens: int, streams: int) -> float:
    mirror = LogMirror(log)
    ss = [RequestStream(uuid.uuid4().hex, _BIG) for _ in range(streams)]
    copies = []
    for s in ss:
        s.start("m")
        copies.append(mirror.watch(s, record_id="bench", prompt_tokens=1, on_fenced=lambda: None))
    per = tokens // streams
    t0 = time.perf_counter()
    for i in range(per):
        for s in ss:
            s.delta(b"x", (TokenInfo(i),))
    while any(c.last_seq < per for c in copies):
        time.sleep(0.0005)
    dt = time.perf_counter() - t0
    mirror.flush(0)
    return dt / (per * streams)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--redis-url", default=None)
    a = ap.parse_args()
    proc, url, d = (None, a.redis_url, None) if a.redis_url else _start_redis()
    try:
        log = RedisStreamLog(url, prefix=f"bench{uuid.uuid4().hex[:6]}:")
        for _ in range(50):
            try:
                log.r.ping()
                break
            except Exception:
                time.sleep(0.1)
        log.fence = str(log.r.incr(f"{log.prefix}fence"))
        base = in_memory(a.tokens)
        one = redis_one(log, a.tokens // 4)
        mirrored = redis_mirror(log, a.tokens, a.streams)
        print(f"in-memory log       {base * 1e6:8.2f} us/token")
        print(f"redis, 1 trip/event {one * 1e6:8.2f} us/token  (+{(one - base) * 1e6:.2f})")
        print(f"redis mirror x{a.streams:<4d}  {mirrored * 1e6:8.2f} us/token  "
              f"(+{(mirrored - base) * 1e6:.2f}; wall time per token over all streams)")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(d or "", ignore_errors=True)


if __name__ == "__main__":
    main()
