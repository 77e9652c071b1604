"""1 vs 2 engine replicas on Ray Serve against one in-process engine, in the same run (issue
12 item 6): aggregate tokens/s and p50/p99 time to first token. Prints figures only.

Run: ``python benchmarks/bench_replicas.py [--requests 64 --max-tokens 48 --concurrency 16]``
(the embedded default model; starts a local Ray with 2 CPUs). At equal total threads (the
in-process engine with 2 torch threads, 2 replicas with 1 each) the ratio is the overhead of
the distributed path; with two cores two replicas cannot beat one engine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams
from coda.stream import EventType


async def _load(engine: Any, n: int, max_tokens: int, concurrency: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
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

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(n)))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(ttfts, n=100)
    return {"tok_s": tokens / wall, "ttft_p50_ms": q[49] * 1e3, "ttft_p99_ms": q[98] * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    a = ap.parse_args()
    import torch

    cfg = EngineConfig(max_num_seqs=16)
    torch.set_num_threads(2)
    with AsyncEngine.from_model_dir(None, cfg) as local:
        base = asyncio.run(_load(local, a.requests, a.max_tokens, a.concurrency))
    from coda.scaleout.deploy import start_replicas, stop_replicas
    from coda.scaleout.remote import RemoteEngine

    two = start_replicas(2, None, cfg, num_cpus=1, torch_threads=1, local_cpus=2)
    try:
        one = RemoteEngine(two.replicas[:1], cfg)
        r1 = asyncio.run(_load(one, a.requests, a.max_tokens, a.concurrency))
        r2 = asyncio.run(_load(two, a.requests, a.max_tokens, a.concurrency))
    finally:
        stop_replicas()
    for name, r in (("in-process, 2 threads", base), ("1 replica, 1 thread", r1),
                    ("2 replicas, 1 thread each", r2)):
        print(f"{name:28s} {r['tok_s']:8.1f} tok/s ({r['tok_s'] / base['tok_s']:.2f}x)  "
              f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms")


if __name__ == "__main__":
    main()
