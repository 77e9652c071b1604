"""Two builds' exact-mode block matmuls (``linear``, f32 mode) in one process, alternating, per
row count (issues 18, 21; T4): what an extra row of a decode step (or a drafted token's
verification row) costs.

SmolLM2-135M's shapes (per layer fused qkv 960 x 576, o 576 x 576, fused gate_up 3072 x 576,
down 576 x 1536, times 30, and the 49 152 x 576 head) on random blocks of one kind; each M
prints the medians of the calling thread's CPU time for a step's matmuls in each build, their
ratio, and whether the two builds' outputs are bit-identical (they must be):

    python benchmarks/bench_rows_ab.py BASE.so BRANCH.so --kind Q4_1 --rows 1,2,4,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from benchmarks.bench_native_ab import load  # NOTE: one loader of a build's .so by path
from coda.models.kernels.ggml_linear import KINDS, repack

SHAPES = [(960, 576, 30), (576, 576, 30), (3072, 576, 30), (576, 1536, 30), (49152, 576, 1)]


def blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random GGUF rows [n, row bytes] with small float16 scales (finite outputs)."""
    size, qb = KINDS[kind]
    raw = rng.integers(0, 256, (n, k // 32, size), dtype=np.uint8)
    fields = rng.uniform(-0.05, 0.05, (n, k // 32, (size - qb) // 2)).astype(np.float16)
    raw[..., :size - qb] = fields.view(np.uint8)
    return raw.reshape(n, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("branch")
    ap.add_argument("--kind", default="Q4_1", choices=sorted(KINDS))
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    mods = {"base": load("base", args.base), "branch": load("branch", args.branch)}
    for mod in mods.values():
        mod.set_threads(1)
    rng = np.random.default_rng(0)
    kind = list(KINDS).index(args.kind)
    mats = [(*repack(blocks(args.kind, n, k, rng), args.kind, n, k), n, k, w)
            for n, k, w in SHAPES]
    print("| M | base ms | branch ms | branch / base | bits equal |\n|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k) for _, _, _, k, _ in mats]
        ys = {s: [torch.empty(m, n) for _, _, n, _, _ in mats] for s in mods}
        times: dict[str, list[float]] = {s: [] for s in mods}
        for _ in range(args.repeats):
            for side, mod in mods.items():  # NOTE: alternating, so drifting load hits both
                t = 0.0
                for (sc, qs, n, k, w), x, y in zip(mats, xs, ys[side], strict=True):
                    t0 = time.process_time()
                    mod.linear(x.data_ptr(), m, k, sc.data_ptr(), qs.data_ptr(), n, kind, False,
                               y.data_ptr())
                    t += (time.process_time() - t0) * w
                times[side].append(t * 1e3)
        base, branch = (statistics.median(times[s]) for s in mods)
        same = all(torch.equal(a, b) for a, b in zip(ys["base"], ys["branch"], strict=True))
        print(f"| {m} | {base:.1f} | {branch:.1f} | {branch / base:.3f} | {same} |")


if __name__ == "__main__":
    main()
