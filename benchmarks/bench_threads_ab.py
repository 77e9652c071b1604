"""Builds of ``coda._native`` side by side at 1 and 2 pool threads on a 1B decode step's matmuls
(issue 18: two threads at batch 1).

Every projection of 16 layers and the head, in ``bench_kquants.py``'s shapes and type mixes
(``Q4_0``: re-laid-out tiles with a Q6_K head; ``Q4_K_M``: K-quant segments read in place;
``/q8`` for ``packed-q8``), as one step per (build, threads) in turn, interleaved, wall clock.
Each step also records the run-queue wait of the process's threads (``/proc/self/task/*/
schedstat``): on a shared machine a 2-thread step is slow when the second core is someone
else's, which this shows apart from the kernels' own cost; ``cpu`` is the CPU time of all the
process's threads (spinning included). Outputs must be bit-identical across builds and
thread counts (printed if not).

    PYTHONPATH=. python benchmarks/bench_threads_ab.py --modes Q4_0/q8,Q4_0 --batches 1,8 \\
        BASE.so BRANCH.so
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kquants as bk  # noqa: E402
from bench_native_ab import load  # noqa: E402  (one build's module, loaded beside the others)


def build(mode: str, layers: int) -> list[tuple[torch.nn.Module, int]]:
    rng = np.random.default_rng(0)
    mix, _, act = mode.partition("/")
    pick = bk.MIXES[mix]

    def make(names: list[tuple[str, int]], layer: int, cols: int) -> torch.nn.Module:
        parts = [(pick(n, layer), r) for n, r in names]
        return bk.packed(parts, cols, rng, "q8" if act == "q8" else "f32")

    mats = []
    for i in range(layers):
        mats.append((make([("q", bk.NH * bk.HD), ("k", bk.NKV * bk.HD), ("v", bk.NKV * bk.HD)],
                          i, bk.H), bk.H))
        mats.append((make([("o", bk.H)], i, bk.NH * bk.HD), bk.NH * bk.HD))
        mats.append((make([("gate", bk.FFN), ("up", bk.FFN)], i, bk.H), bk.H))
        mats.append((make([("down", bk.H)], i, bk.FFN), bk.FFN))
    mats.append((make([("head", bk.VOCAB)], layers, bk.H), bk.H))
    return mats


def sched(tid: int | None = None) -> tuple[float, float]:
    """(run, run-queue wait) seconds of one thread, or of all the process's threads."""
    run = wait = 0
    for t in [str(tid)] if tid is not None else os.listdir("/proc/self/task"):
        try:
            r, w, _ = Path(f"/proc/self/task/{t}/schedstat").read_text().split()
        except FileNotFoundError:
            continue
        run, wait = run + int(r), wait + int(w)
    return run / 1e9, wait / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("builds", nargs="+", help="_native*.so files")
    ap.add_argument("--modes", default="Q4_0/q8,Q4_0,Q4_K_M/q8,Q4_K_M")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=bk.LAYERS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mods = [load(f"ab{i}", p) for i, p in enumerate(args.builds)]
    threads = [int(t) for t in args.threads.split(",")]
    modes = args.modes.split(",")
    mats = {m: build(m, args.layers) for m in modes}
    me = threading.get_native_id()
    res: dict[tuple[str, int, int, int], list[tuple[float, float, float, float]]] = {}
    load0 = os.getloadavg()[0]
    for M in (int(b) for b in args.batches.split(",")):
        xs = {k: torch.randn(M, k) for k in (bk.H, bk.FFN)}
        bits: dict[str, list[bytes]] = {}
        for rep in range(args.repeats):
            order = [(i, nt) for i in range(len(mods)) for nt in threads]
            for i, nt in order[::-1] if rep % 2 else order:
                for j, mod in enumerate(mods):
                    mod.set_threads(nt if j == i else 1)  # NOTE: one pool at a time
                for mode in modes:
                    for mat, _ in mats[mode]:
                        mat._linear = getattr(mods[i], mat._linear.__name__)
                    mats[mode][0][0](xs[bk.H])  # NOTE: the pool's worker awake
                    r0, w0 = sched()
                    m0 = sched(me)[1]
                    t0 = time.perf_counter()
                    ys = [mat(xs[c]) for mat, c in mats[mode]]
                    t = time.perf_counter() - t0
                    r1, w1 = sched()
                    res.setdefault((mode, M, i, nt), []).append(
                        (t, r1 - r0, w1 - w0, sched(me)[1] - m0))
                    out = [y.numpy().tobytes() for y in ys]
                    if bits.setdefault(mode, out) != out:
                        print(f"BITS DIFFER: {mode} M={M} build {i} {nt} threads")
        for mode in modes:
            cells = []
            for i in range(len(mods)):
                for nt in threads:
                    v = res[(mode, M, i, nt)]
                    med = [statistics.median(x[k] for x in v) * 1e3 for k in range(4)]
                    cells.append(f"{med[0]:.1f} (cpu {med[1]:.0f}, run-queue {med[2]:.1f}, "
                                 f"caller's {med[3]:.1f})")
            print(f"| {mode} | {M} | " + " | ".join(cells) + " |", flush=True)
    print(f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}; medians of {args.repeats}; "
          f"{args.layers} layers + head; wall ms per step (cpu: all threads; run-queue wait: all "
          f"threads, then the calling thread's); columns: "
          + ", ".join(f"{Path(b).name} {nt}t" for b in args.builds for nt in threads))


if __name__ == "__main__":
    main()
