"""Two builds of ``coda._native`` on the Q4_0/Q4_1/Q8_0 q8 kernel, alternating (issue 18).

``bench_native_ab.py`` times the K-quant kernel; this times the re-laid-out block kernel
(``csrc/blocks_q8.h``, ``linear(..., q8=True)``) on a 1B-shaped step's projections (16 layers of
fused qkv 3072 x 2048, o 2048 x 2048, fused gate_up 16384 x 2048, down 2048 x 8192; random
quants, float16 scales 1e-3), each build in turn, and prints the medians and whether the two
builds' outputs are bit-identical (they must be):

    python benchmarks/bench_blocks_q8_ab.py BASE.so BRANCH.so --kind Q4_0 --m 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from benchmarks.bench_native_ab import load

KINDS = {"Q4_0": 0, "Q4_1": 1, "Q8_0": 2}  # NOTE: table.h's Kind
SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("branch")
    ap.add_argument("--kind", choices=sorted(KINDS), default="Q4_0")
    ap.add_argument("--m", type=int, default=1, help="input rows (the batch)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--f32", action="store_true", help="the exact mode (float activations)")
    ap.add_argument("--isa", default=None,
                    help="the build both sides use, or A,B: one each (e.g. avx2,avx512)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    args = ap.parse_args()
    mods = {"a": load("blocks_ab_base", args.base), "b": load("blocks_ab_branch", args.branch)}
    isas = (args.isa.split(",") * 2)[:2] if args.isa else None
    for i, mod in enumerate(mods.values()):
        mod.set_threads(args.threads)
        if isas:
            mod.set_isa(isas[i])
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    kind, m = KINDS[args.kind], args.m
    qb, nsc = (32 if args.kind == "Q8_0" else 16), (16 if args.kind == "Q4_1" else 8)
    rng = np.random.default_rng(0)
    mats = []
    for _ in range(args.layers):
        for n, k in SHAPES:
            sc = np.full(n // 8 * k // 32 * nsc, 1e-3, np.float16).view(np.uint16)
            qs = rng.integers(0, 256, n // 8 * k // 32 * 8 * qb, dtype=np.uint8)
            mats.append((n, k, sc, qs, {s: np.zeros((m, n), np.float32) for s in "ab"}))
    xs = {k: rng.standard_normal((m, k)).astype(np.float32) for k in (2048, 8192)}
    times: dict[str, list[float]] = {"a": [], "b": []}
    for rep in range(args.repeats + 1):
        for side, mod in mods.items():
            t0 = clock()
            for n, k, sc, qs, y in mats:
                mod.linear(xs[k].ctypes.data, m, k, sc.ctypes.data, qs.ctypes.data, n, kind,
                           not args.f32, y[side].ctypes.data)
            if rep:  # NOTE: the first round warms up (first touch of the weights)
                times[side].append(clock() - t0)
    same = all(np.array_equal(y["a"].view(np.uint32), y["b"].view(np.uint32))
               for *_, y in mats)
    a, b = (statistics.median(times[s]) for s in "ab")
    mb = sum(sc.nbytes + qs.nbytes for _, _, sc, qs, _ in mats) / 1e6
    print(f"load average {os.getloadavg()[0]:.1f}; {args.kind} "
          f"{'f32' if args.f32 else 'q8'}, {mods['a'].isa()} / {mods['b'].isa()}, M={m}, "
          f"{args.threads} threads, "
          f"{mb:.0f} MB, {args.clock} clock, medians of {args.repeats}: base {a * 1e3:.2f} ms, "
          f"branch {b * 1e3:.2f} ms, branch / base {b / a:.3f}, bits equal {same}")


if __name__ == "__main__":
    main()
