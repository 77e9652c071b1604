"""Cost of the durable stream log per token (issue 12 item 6): the Redis Streams log against the
in-memory log of one process, in the same run. Prints figures only (no asserts on time).

Run: ``python benchmarks/bench_stream_log.py`` (starts a throwaway ``redis-server`` on loopback
with AOF ``appendfsync everysec``; ``--redis-url`` uses an existing one). One token per delta,
as the engine emits them. Three writers of the same events:

* ``in-memory`` — :meth:`coda.stream.RequestStream.delta` (today's log);
* ``redis-1``   — one Lua append per event, one round trip each (a writer that never batches);
* ``redis-mirror`` — :class:`coda.durable.mirror.LogMirror` as the server runs it: ``--streams``
  concurrent streams (default 32 and 256, each measured), a writer thread sending whatever
  accumulated since its last round trip; the producer appends as fast as it can (the mirror's
  flushes grow to hundreds of events), wall time per token, and CPU per token of this process
  (producer, observers' loop, mirror) plus Redis's (``INFO cpu``): the wall time leaves out
  what Redis does on another core, the CPU sum counts it (``--cpus 0`` pins this process and
  Redis to one core, so the wall time counts it too);
* ``paced`` — the same mirror fed like a decoding engine: one token per stream per step, a
  step every ``--step-ms``, each step's end signalled as an engine does (the mirror flushes
  at it), so most flushes carry one event per stream (the worst case for
  batching). Figures are CPU per token: the producer's appends with and without the mirror
  observing (a post to the wake-up channel; the mirror's mark runs on the observers' loop),
  the mirror thread (encoding, the round trip's client side, the durable copy), and
  Redis's main thread (``INFO cpu``) — what the log costs the serving process and Redis,
  independent of the machine's other load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Any

from coda.durable.mirror import LogMirror
from coda.durable.redis_log import RedisStreamLog
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import State
from coda.stream import EventType, RequestStream, StreamEvent, TokenInfo
from coda.stream_backpressure import BackpressureConfig
from coda.wakeup import CHANNEL

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


def in_memory(tokens: int, streams: int = 1) -> tuple[float, float]:
    """Wall and CPU time per token of the in-memory log, ``streams`` appended in turn."""
    ss = [RequestStream(uuid.uuid4().hex, _BIG) for _ in range(streams)]
    for s in ss:
        s.start("m")
    per = tokens // streams
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(per):
        for s in ss:
            s.delta(b"x", (TokenInfo(i),))
    return (time.perf_counter() - t0) / (per * streams), (time.process_time() - c0) / (
        per * streams)


def redis_one(log: RedisStreamLog, tokens: int) -> float:
    rid = uuid.uuid4().hex
    log.open(rid, prompt_tokens=1)
    log.append(StreamEvent(rid, 0, EventType.START, model="m"))
    t0 = time.perf_counter()
    for i in range(tokens):
        log.append(StreamEvent(rid, i + 1, EventType.DELTA, b"x", (TokenInfo(i),)))
    return (time.perf_counter() - t0) / tokens


_LOOP: list[asyncio.AbstractEventLoop] = []


def _observers() -> asyncio.AbstractEventLoop:
    """The event loop the mirror observes streams on (the server's, in ``coda serve``), on
    its own thread: appends post to the wake-up channel, the mirror is woken there."""
    if not _LOOP:
        _LOOP.append(asyncio.new_event_loop())
        threading.Thread(target=_LOOP[0].run_forever, name="observers", daemon=True).start()
    return _LOOP[0]


class _Engine:
    """What the mirror sees of an engine (``LogMirror(steps=...)``): a ``stepping`` flag and
    each step's end posted on the wake-up channel with it as the source."""

    stepping = False


def _mirror(log: RedisStreamLog, hold_ms: float | None, cls: type[LogMirror] = LogMirror,
            steps: _Engine | None = None) -> LogMirror:
    kw: dict[str, Any] = {} if hold_ms is None else {"hold_s": hold_ms / 1e3}
    if steps is not None:
        try:  # NOTE: a build whose mirror does not take the engine's steps holds instead
            return cls(log, steps=steps, **kw)
        except TypeError:
            pass
    return cls(log, **kw)


def redis_mirror(log: RedisStreamLog, tokens: int, streams: int, hold_ms: float | None = None
                 ) -> tuple[float, float]:
    """Wall time and CPU (this process and Redis) per token through the mirror, saturated."""
    mirror = _mirror(log, hold_ms)
    ss = [RequestStream(uuid.uuid4().hex, _BIG) for _ in range(streams)]
    copies = []
    for s in ss:
        s.start("m")
        copies.append(mirror.watch(s, record_id="bench", prompt_tokens=1, on_fenced=lambda: None,
                                   loop=_observers()))
    per = tokens // streams
    r0, c0, t0 = _redis_cpu(log), time.process_time(), time.perf_counter()
    for i in range(per):
        for s in ss:
            s.delta(b"x", (TokenInfo(i),))
    while any(c.last_seq < per for c in copies):
        time.sleep(0.0005)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0 + _redis_cpu(log) - r0
    mirror.flush(0)
    return dt / (per * streams), cpu / (per * streams)


class _TimedMirror(LogMirror):
    """The server's mirror, counting the CPU time its writer thread spends flushing."""

    cpu_s = 0.0

    def _flush(self, batch: list[Any]) -> None:
        t = time.thread_time()
        super()._flush(batch)
        self.cpu_s += time.thread_time() - t


def _redis_cpu(log: RedisStreamLog) -> float:
    info = log.r.info("cpu")
    return float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"])


def paced(log: RedisStreamLog | None, steps: int, streams: int, step_s: float,
          hold_ms: float | None = None) -> tuple[float, float, float]:
    """CPU per token: (producer appends, mirror thread, Redis main thread); no mirror if
    ``log`` is None. The producer signals its steps as an engine does (the mirror then
    flushes at each step's end; ``--hold-ms`` applies to a mirror without steps)."""
    engine = _Engine()
    mirror = _mirror(log, hold_ms, _TimedMirror, engine) if log is not None else None
    ss = [RequestStream(uuid.uuid4().hex, _BIG) for _ in range(streams)]
    for s in ss:
        s.start("m")
        if mirror is not None:
            mirror.watch(s, record_id="bench", prompt_tokens=1, on_fenced=lambda: None,
                         loop=_observers())
    redis0 = _redis_cpu(log) if log is not None else 0.0
    produce = 0.0
    next_step = time.perf_counter()
    for i in range(steps):
        t = time.thread_time()
        engine.stepping = True
        for s in ss:
            s.delta(b" tok", (TokenInfo(i, piece=b" tok"),))
        engine.stepping = False
        CHANNEL.post(engine, i)
        produce += time.thread_time() - t
        next_step += step_s
        time.sleep(max(0.0, next_step - time.perf_counter()))
    if mirror is None:
        return produce / (steps * streams), 0.0, 0.0
    for s in ss:
        s.close(Terminal(State.FINISHED, FinishReason.EOS, Usage()))
    mirror.flush(30)
    n = steps * streams
    return produce / n, mirror.cpu_s / n, (_redis_cpu(log) - redis0) / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20000)
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--hold-ms", type=float, default=None,
                    help="the mirror's flush hold (default: the mirror's own)")
    ap.add_argument("--cpus", type=int, nargs="*", default=None,
                    help="pin this process and the Redis it starts to these CPUs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-paced", action="store_true")
    a = ap.parse_args()
    if a.cpus:
        os.sched_setaffinity(0, a.cpus)  # NOTE: inherited by the redis-server started below
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
        one = redis_one(log, a.tokens // 20)
        for streams in a.streams:
            _report(log, a, streams, one)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
            shutil.rmtree(d or "", ignore_errors=True)


def _report(log: RedisStreamLog, a: argparse.Namespace, streams: int, one: float) -> None:
    rows: list[tuple[float, ...]] = []
    load = [os.getloadavg()[0]]
    for _ in range(a.repeats):  # NOTE: interleaved, so a change of load hits all alike
        base, base_cpu = in_memory(a.tokens, streams)
        mirrored, mirrored_cpu = redis_mirror(log, a.tokens, streams, a.hold_ms)
        row = [base, mirrored, mirrored - base, base_cpu, mirrored_cpu, mirrored_cpu - base_cpu]
        if not a.no_paced:
            p_mem, _, _ = paced(None, a.steps, streams, a.step_ms / 1e3)
            p_prod, p_mirror, p_redis = paced(log, a.steps, streams, a.step_ms / 1e3,
                                              a.hold_ms)
            row += [p_mem, p_prod, p_mirror, p_prod - p_mem + p_mirror, p_redis]
        rows.append(tuple(row))
        load.append(os.getloadavg()[0])
    med = [statistics.median(col) * 1e6 for col in zip(*rows, strict=True)]
    base, mirrored, diff, base_cpu, mirrored_cpu, diff_cpu = med[:6]
    print(f"x{streams} streams: medians of {a.repeats} "
          f"(load average {min(load):.1f}..{max(load):.1f})")
    print(f"in-memory log       {base:8.2f} us/token  (CPU {base_cpu:.2f})")
    print(f"redis, 1 trip/event {one * 1e6:8.2f} us/token  (one run)")
    print(f"redis mirror x{streams:<4d}  {mirrored:8.2f} us/token  "
          f"(+{diff:.2f} over in-memory; wall time per token over all streams) "
          f"[{' '.join(format((r[2]) * 1e6, '+.1f') for r in rows)}]")
    print(f"  CPU, this process + Redis: {mirrored_cpu:.2f} us/token (+{diff_cpu:.2f} over "
          f"in-memory) [{' '.join(format(r[5] * 1e6, '+.1f') for r in rows)}]")
    if a.no_paced:
        return
    p_mem, p_prod, p_mirror, extra, p_redis = med[6:]
    print(f"paced x{streams} every {a.step_ms:g} ms, CPU per token: appends "
          f"{p_mem:.2f} us in memory, {p_prod:.2f} us with the mirror observing; "
          f"mirror thread {p_mirror:.2f} us; Redis {p_redis:.2f} us")
    print(f"paced: the log costs the serving process +{extra:.2f} us/token "
          f"(post + mirror thread), Redis {p_redis:.2f} us/token")


if __name__ == "__main__":
    main()
