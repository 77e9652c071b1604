"""Issue 21: the native attention call (``coda._native.attend``: RoPE, the cache write and
attention, ``csrc/rows.h``) for one sequence's ``M`` query rows, as a verification of
``M - 1`` drafted tokens runs it, at SmolLM2-135M's head shape (9 query heads, 3 KV heads,
d 64). Times the native call alone (no Python checks) on the calling thread's CPU clock, one
kernel thread, medians of ``--repeats`` calls; prints us per call for each ``M`` and context,
and the cost of an extra row. Compare builds by running it under each tree:

    PYTHONPATH=. python benchmarks/bench_attend_rows.py --contexts 300,450 --rows 1,2,3,5,9
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from coda.models.kernels import native, set_threads

H, HKV, D, BS = 9, 3, 64, 16


def per_call_us(ctx: int, m: int, repeats: int) -> float:
    """Median us of the native call for rows at positions ctx .. ctx + m - 1."""
    nblk = (ctx + m + BS) // BS + 1
    gen = torch.Generator().manual_seed(ctx + m)
    kv = torch.randn(2, HKV, nblk, BS, D, generator=gen)
    table = torch.arange(nblk, dtype=torch.int64).view(1, -1)
    qkv = torch.randn(m, (H + 2 * HKV) * D, generator=gen)
    cos, sin = torch.randn(m, D, generator=gen), torch.randn(m, D, generator=gen)
    pos = torch.arange(ctx, ctx + m, dtype=torch.int64)
    seq = torch.zeros(m, dtype=torch.int64)
    out = torch.empty(m, H * D)
    args = (qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv.data_ptr(), pos.data_ptr(),
            seq.data_ptr(), pos.data_ptr(), table.data_ptr(), m, H, HKV, D, nblk, BS, 1, nblk,
            out.data_ptr(), D, 0, 0.0, 0, 0, 1e-6)
    call = native().attend
    for _ in range(5):
        call(*args)
    times = []
    for _ in range(repeats):
        t = time.thread_time()
        call(*args)
        times.append(time.thread_time() - t)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="300,450")
    ap.add_argument("--rows", default="1,2,3,5,9")
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    set_threads(1)
    ms = [int(r) for r in args.rows.split(",")]
    print(f"build {native().isa()}, load {os.getloadavg()[0]:.2f}; us per call (median)")
    print("| context | " + " | ".join(f"M = {m}" for m in ms) + " | extra row |")
    print("|---" * (len(ms) + 2) + "|")
    for ctx in (int(c) for c in args.contexts.split(",")):
        us = [per_call_us(ctx, m, args.repeats) for m in ms]
        extra = (us[-1] - us[0]) / (ms[-1] - ms[0]) if len(ms) > 1 else 0.0
        print(f"| {ctx} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {extra:.1f} |")


if __name__ == "__main__":
    main()
