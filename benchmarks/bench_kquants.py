"""Decode-step matmuls of a 1B-shaped model in the GGUF type mixes llama.cpp writes (issue 18).

Shape of Llama-3.2-1B: hidden 2048, 16 layers, 32/8 heads of 64, FFN 8192, a 49152-row head
(SmolLM2's vocabulary). One step = every layer's fused qkv, o, fused gate_up and down, plus the
head, for M rows (the batch), as the ``packed`` mode runs them: each mix's tensors are random row
bytes of its types (finite float16 scales; the kernels' speed does not depend on the values),
fused projections are one call over their parts (:class:`KQuantLinear`), Q4_0/Q4_1/Q8_0-only
projections go to the re-laid-out kernel (:class:`GgmlLinear`) as ``packed`` does. ``fp32`` is
the dense ``F.linear`` fallback ``auto`` chose for these files before issue 18 (float32
weights, 8x the memory of Q4). Printed: ms per step and decode tok/s = M / step (the matmuls'
share of a decode step; attention, norms and sampling come on top), medians of interleaved
repeats, and the weight bytes each mode streams per step.

    nice -n 10 python benchmarks/bench_kquants.py --mixes Q4_K_M,Q4_0,Q6_K --batches 1,8

``--q8`` adds each mix in ``packed-q8`` (``<mix>/q8``); ``--clock cpu`` times the calling
thread's CPU time (1 thread: the kernels' own cost on a machine shared with other jobs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from coda.models.kernels import native
from coda.models.kernels.ggml_linear import GgmlLinear
from coda.models.kernels.kquant_linear import Q8K_TYPES, TYPES, KQuantLinear, Segment

H, LAYERS, NH, NKV, HD, FFN, VOCAB = 2048, 16, 32, 8, 64, 8192, 49152
SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def q4_k_m(name: str, layer: int) -> str:
    """llama.cpp's Q4_K_M: Q4_K, with Q6_K on the head and on attn_v / ffn_down of about half
    the layers (its use_more_bits: the first and last eighth, and every third in between)."""
    more = layer < LAYERS // 8 or layer >= 7 * LAYERS // 8 or (layer - LAYERS // 8) % 3 == 2
    if name == "head" or (name in ("v", "down") and more):
        return "Q6_K"
    return "Q4_K"


def q5_k_m(name: str, layer: int) -> str:
    return "Q6_K" if q4_k_m(name, layer) == "Q6_K" else "Q5_K"


MIXES: dict[str, Callable[[str, int], str]] = {
    "Q4_0": lambda name, layer: "Q6_K" if name == "head" else "Q4_0",  # llama.cpp's Q4_0 file
    "Q4_K_M": q4_k_m,
    "Q5_K_M": q5_k_m,
    "Q6_K": lambda name, layer: "Q6_K",
    "Q3_K": lambda name, layer: "Q6_K" if name == "head" else "Q3_K",
}


def random_rows(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    _, per, size = TYPES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in SCALES[qtype]:
        d = np.full(raw.shape[:2], 1e-3, np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


class Dense(nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w = torch.randn(rows, cols) * 0.02

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


def packed(parts: list[tuple[str, int]], cols: int, rng: np.random.Generator,
           act: str = "f32") -> nn.Module:
    """As ``packed`` (act ``f32``) or ``packed-q8`` (``q8``: int8 blocks of 32 for Q4_0/Q4_1/
    Q8_0, Q8_K for K-quants) load the parts."""
    raws = [random_rows(q, rows, cols, rng) for q, rows in parts]
    kinds = {q for q, _ in parts}
    if len(kinds) == 1 and parts[0][0] in ("Q4_0", "Q4_1", "Q8_0"):
        return GgmlLinear(np.concatenate(raws), parts[0][0], sum(r for _, r in parts), cols,
                          act=act)
    return KQuantLinear([Segment(raw, q, (r, cols)) for raw, (q, r) in zip(raws, parts, strict=True)],
                        act=act if kinds <= set(Q8K_TYPES) else "f32")


def model(mode: str, layers: int) -> tuple[Callable[[torch.Tensor], None], int]:
    """The step function and the weight bytes it streams (mode: ``fp32``, a mix, or
    ``<mix>/q8`` for the mix in ``packed-q8``)."""
    rng = np.random.default_rng(0)
    mix, _, act = mode.partition("/")
    pick = MIXES.get(mix)
    mats: list[tuple[nn.Module, int]] = []
    nbytes = 0

    def make(names: list[tuple[str, int]], layer: int, cols: int) -> nn.Module:
        nonlocal nbytes
        if pick is None:
            nbytes += 4 * cols * sum(r for _, r in names)
            return Dense(sum(r for _, r in names), cols)
        parts = [(pick(n, layer), r) for n, r in names]
        nbytes += sum(r * cols // TYPES[q][1] * TYPES[q][2] for q, r in parts)
        return packed(parts, cols, rng, "q8" if act == "q8" else "f32")

    for i in range(layers):
        mats.append((make([("q", NH * HD), ("k", NKV * HD), ("v", NKV * HD)], i, H), H))
        mats.append((make([("o", H)], i, NH * HD), NH * HD))
        mats.append((make([("gate", FFN), ("up", FFN)], i, H), H))
        mats.append((make([("down", H)], i, FFN), FFN))
    head = make([("head", VOCAB)], layers, H)

    def step(x: torch.Tensor) -> None:
        xf = torch.zeros(x.shape[0], FFN)
        for mat, cols in mats:
            mat(x if cols == H else xf)
        head(x)

    return step, nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mixes", default="Q4_K_M,Q4_0")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--q8", action="store_true", help="also each mix in packed-q8 (<mix>/q8)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native().set_threads(args.threads)
    mixes = args.mixes.split(",")
    modes = ["fp32", *mixes, *([f"{m}/q8" for m in mixes] if args.q8 else [])]
    steps = {m: model(m, args.layers) for m in modes}
    batches = [int(b) for b in args.batches.split(",")]
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    times: dict[tuple[str, int], list[float]] = {}
    for b in batches:
        x = torch.randn(b, H)
        for m in modes:
            steps[m][0](x)  # NOTE: warm-up (first touch of the weights)
        for _ in range(args.repeats):
            for m in modes:
                t0 = clock()
                steps[m][0](x)
                times.setdefault((m, b), []).append(clock() - t0)
    print(f"load average {os.getloadavg()}; {args.threads} threads; isa {native().isa()}; "
          f"{args.layers} layers + head; medians of {args.repeats} interleaved repeats; "
          f"{args.clock} clock")
    print("| mode | weight MB | " + " | ".join(f"M={b} ms (tok/s, × fp32)" for b in batches) + " |")
    print("|---" * (len(batches) + 2) + "|")
    for m in modes:
        cells = []
        for b in batches:
            med = statistics.median(times[(m, b)])
            ref = statistics.median(times[("fp32", b)])
            cells.append(f"{med * 1e3:.0f} ({b / med:.1f}, {ref / med:.2f}×)")
        print(f"| {m} | {steps[m][1] / 1e6:.0f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
