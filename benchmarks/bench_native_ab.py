"""Two builds of ``coda._native`` in one process, alternating, on the same weights (issue 18).

On a shared machine the load drifts between two runs more than a kernel change moves them, so
this loads a base build and a branch build side by side (each ``_native*.so`` under its own
module name), calls them in turn on the same random K-quant rows and inputs, and prints the
medians of the calling thread's CPU time (``--clock cpu``, 1 thread: the kernels' own cost) or
wall time, and whether the two builds' outputs are bit-identical (they must be: exact bits are
the contract).

``--what types`` times one 4096 x 2048 matrix per type; ``--what step`` a 1B-shaped decode step
(16 layers of fused qkv, o, fused gate_up, down, and a 49 152-row Q6_K head) of a mix:

    python benchmarks/bench_native_ab.py BASE.so BRANCH.so --what types --types Q4_K,Q6_K
    python benchmarks/bench_native_ab.py BASE.so BRANCH.so --what step --mix Q4_K_M --threads 2

Legacy types: Q4_0, Q4_1 and Q8_0 run re-laid-out (``linear``, ``csrc/blocks.h``: what the
``packed`` modes load them as), Q5_0 and Q5_1 in place (``kq_linear``); ``--mix Q4_0`` is
llama.cpp's Q4_0 file (Q4_0 projections, a Q6_K head). ``--legacy A,B`` picks per side how
Q4_0/Q4_1/Q8_0 run (``relaid`` or ``inplace``: the same bits either way), so one build can
compare its in-place kernel with its re-laid-out one; ``--shape NxK`` sets the ``types`` matrix
(Gemma 3 270M's tied Q8_0 embedding-and-head is 262144x640):

    python benchmarks/bench_native_ab.py B.so B.so --types Q8_0 --shape 262144x640 \
        --legacy relaid,inplace
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import time
from types import ModuleType
from typing import Any

import numpy as np

# ggml type number, block bytes, offsets of the float16 scales in a block
TYPES = {"Q4_0": (2, 18, (0,)), "Q4_1": (3, 20, (0, 2)), "Q5_0": (6, 22, (0,)),
         "Q5_1": (7, 24, (0, 2)), "Q8_0": (8, 34, (0,)), "Q2_K": (10, 84, (80, 82)), "Q3_K": (11, 110, (108,)), "Q4_K": (12, 144, (0, 2)),
         "Q5_K": (13, 176, (0, 2)), "Q6_K": (14, 210, (208,))}
H, LAYERS, NH, NKV, HD, FFN, VOCAB = 2048, 16, 32, 8, 64, 8192, 49152


def load(name: str, path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"{name}._native", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


RELAID = ("Q4_0", "Q4_1", "Q8_0")  # ggml_linear.KINDS, in its kind-number order


def rows(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    _, bb, scales = TYPES[qtype]
    per = 256 if qtype.endswith("_K") else 32
    raw = rng.integers(0, 256, size=(n, k // per, bb), dtype=np.uint8)
    for off in scales:
        d = np.full(raw.shape[:2], 1e-3, np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return np.ascontiguousarray(raw.reshape(n, -1))


def pick(mix: str, name: str, layer: int) -> str:
    """llama.cpp's Q4_K_M (Q6_K head, Q6_K attn_v / ffn_down on about half the layers), or
    ``mix`` everywhere but a Q6_K head."""
    if mix != "Q4_K_M":
        return "Q6_K" if name == "head" else mix
    more = layer < LAYERS // 8 or layer >= 7 * LAYERS // 8 or (layer - LAYERS // 8) % 3 == 2
    return "Q6_K" if name == "head" or (name in ("v", "down") and more) else "Q4_K"


class Mat:
    """One kq_linear call (or, every part one re-laid-out type, one ``linear`` call): its
    segment table, K, and an output per build."""

    def __init__(self, parts: list[tuple[str, int]], k: int, m: int,
                 rng: np.random.Generator, q8: bool = False) -> None:
        self.raws = [rows(q, n, k, rng) for q, n in parts]
        self.kind = -1
        if len({q for q, _ in parts}) == 1 and parts[0][0] in RELAID:
            from coda.models.kernels.ggml_linear import repack  # NOTE: the worktree's build
            self.kind = RELAID.index(parts[0][0])
            self.sc, self.qs = repack(self.raws, parts[0][0], sum(n for _, n in parts), k,
                                      "q8" if q8 else "f32")
        self.table = np.array([[r.ctypes.data, n, r.shape[1], TYPES[q][0], 0, 0]
                               for r, (q, n) in zip(self.raws, parts, strict=True)], np.int64)
        self.k, self.m = k, m
        self.y = {side: np.zeros((m, sum(n for _, n in parts)), np.float32) for side in "ab"}
        self.nbytes = sum(r.nbytes for r in self.raws)

    def __call__(self, mod: Any, side: str, x: np.ndarray, q8: bool,
                 inplace: bool = False) -> None:
        n = self.y[side].shape[1]
        if self.kind >= 0 and not inplace:
            mod.linear(x.ctypes.data, self.m, self.k, self.sc.data_ptr(), self.qs.data_ptr(), n,
                       self.kind, q8, self.y[side].ctypes.data)
            return
        fn = mod.kq_linear_q8 if q8 else mod.kq_linear
        fn(x.ctypes.data, self.m, self.k, self.table.ctypes.data, len(self.table),
           self.y[side].ctypes.data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("base")
    ap.add_argument("branch")
    ap.add_argument("--what", choices=("types", "step"), default="types")
    ap.add_argument("--types", default="Q4_K,Q6_K,Q5_K,Q3_K,Q2_K")
    ap.add_argument("--mix", default="Q4_K_M")
    ap.add_argument("--m", type=int, default=1, help="input rows (the batch)")
    ap.add_argument("--q8", action="store_true", help="packed-q8 (Q8_K activations)")
    ap.add_argument("--isa", default=None,
                    help="the build both sides use, or A,B: one each (same .so twice compares "
                         "two ISAs, e.g. avx2,avx512)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="cpu")
    ap.add_argument("--legacy", default="relaid,relaid",
                    help="how each side runs Q4_0/Q4_1/Q8_0: relaid or inplace (A,B)")
    ap.add_argument("--shape", default="4096x2048", help="NxK of the --what types matrix")
    args = ap.parse_args()
    legacy = (args.legacy.split(",") * 2)[:2]
    if any(v not in ("relaid", "inplace") for v in legacy):
        ap.error("--legacy takes relaid or inplace, one or two (A,B)")
    inplace = {"a": legacy[0] == "inplace", "b": legacy[1] == "inplace"}
    n_rows, k_cols = (int(v) for v in args.shape.split("x"))
    mods = {"a": load("coda_ab_base", args.base), "b": load("coda_ab_branch", args.branch)}
    isas = (args.isa.split(",") * 2)[:2] if args.isa else None
    for i, mod in enumerate(mods.values()):
        mod.set_threads(args.threads)
        if isas:
            mod.set_isa(isas[i])
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    rng = np.random.default_rng(0)
    groups: list[tuple[str, list[Mat]]] = []
    if args.what == "types":
        groups = [(t, [Mat([(t, n_rows)], k_cols, args.m, rng, args.q8)])
                  for t in args.types.split(",")]
    else:
        mats = []
        for i in range(LAYERS):
            for names, k in (([("q", NH * HD), ("k", NKV * HD), ("v", NKV * HD)], H),
                             ([("o", H)], NH * HD), ([("gate", FFN), ("up", FFN)], H),
                             ([("down", H)], FFN)):
                mats.append(Mat([(pick(args.mix, n, i), r) for n, r in names], k, args.m, rng,
                                args.q8))
        mats.append(Mat([("Q6_K", VOCAB)], H, args.m, rng))
        groups = [(f"{args.mix} step", mats)]
    xs = {k: rng.standard_normal((args.m, k)).astype(np.float32) for k in (H, FFN, k_cols)}
    print(f"load average {os.getloadavg()[0]:.1f}; {args.threads} threads; isa "
          f"{mods['a'].isa()} / {mods['b'].isa()}; M={args.m}; {'packed-q8' if args.q8 else 'packed'}; legacy "
          f"{'/'.join(legacy)}; medians of "
          f"{args.repeats} alternating repeats; {args.clock} clock")
    print("| what | weight MB | base ms | branch ms | branch / base | bits equal |")
    print("|---|---|---|---|---|---|")
    for label, mats in groups:
        times: dict[str, list[float]] = {"a": [], "b": []}
        for rep in range(args.repeats + 1):
            for side, mod in mods.items():
                t0 = clock()
                for mat in mats:
                    mat(mod, side, xs[mat.k], args.q8, inplace[side])
                if rep:  # NOTE: the first round warms up (first touch of the weights)
                    times[side].append(clock() - t0)
        same = all(np.array_equal(m.y["a"].view(np.uint32), m.y["b"].view(np.uint32))
                   for m in mats)
        a, b = (statistics.median(times[s]) for s in "ab")
        mb = sum(m.nbytes for m in mats) / 1e6
        print(f"| {label} | {mb:.0f} | {a * 1e3:.2f} | {b * 1e3:.2f} | {b / a:.2f} | {same} |")


if __name__ == "__main__":
    main()
