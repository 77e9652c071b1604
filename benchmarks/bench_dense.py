"""The batch-invariant dense kernel (``fp32-kernel``) against ``F.linear`` (issue 18 item 2).

Issue 18's goal: within 3% of ``F.linear`` at batch 1 and at least 0.8x its throughput at 512
rows (prefill). Two shape sets, float32 random weights (speed does not depend on the values):

* ``default``: one step of the embedded default model (4 layers of qkv 256->512, o 256->256,
  gate_up 256->1408, down 704->256, plus the tied 4096x256 head);
* ``1b``: one layer of a Llama-3.2-1B-shaped model (qkv 2048->3072, o 2048->2048, gate_up
  2048->16384, down 8192->2048).

Both sides run at the same thread count (torch's pool and the native pool). Repeats are
interleaved (F.linear, kernel, F.linear, ...) and the medians printed with the ratio
``F.linear time / kernel time`` (>= 1: the kernel is faster) from the same run.

    nice -n 10 python benchmarks/bench_dense.py --rows 1,512 --threads 1,2 --repeats 7
    python benchmarks/bench_dense.py --threads 1 --clock cpu  # steadier on a shared machine
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from coda.models.kernels import native
from coda.models.kernels.dense import dense_linear

SHAPES: dict[str, tuple[list[tuple[int, int]], int]] = {
    # name -> ([(K, N) per projection], times the list runs per step)
    "default": ([(256, 512), (256, 256), (256, 1408), (704, 256)] * 4 + [(256, 4096)], 1),
    "1b": ([(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)], 1),
}


def step(shapes: list[tuple[int, int]], rows: int, kernel: bool) -> Callable[[], None]:
    g = torch.Generator().manual_seed(0)
    layers = []
    for k, n in shapes:
        w = torch.randn(n, k, generator=g)
        x = torch.randn(rows, k, generator=g)
        layers.append((dense_linear(w).direct() if kernel else None, w, x))

    def run() -> None:
        for call, w, x in layers:
            if call is not None:
                call(x)
            else:
                F.linear(x, w)

    return run


def timed(fn: Callable[[], None], min_s: float, clock: Callable[[], float]) -> float:
    fn()
    n, t0 = 0, clock()
    while True:
        fn()
        n += 1
        el = clock() - t0
        if el >= min_s:
            return el / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sets", default="default,1b")
    ap.add_argument("--rows", default="1,512")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--min-s", type=float, default=0.3)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the process's CPU time, steadier on a shared machine at 1 thread")
    a = ap.parse_args()
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    print(f"native ISA {native().isa()}; torch {torch.__version__}")
    print(f"{'set':8} {'rows':>5} {'thr':>3} {'F.linear ms':>12} {'kernel ms':>10} {'ratio':>6}")
    for name in a.sets.split(","):
        shapes = SHAPES[name][0]
        for rows in (int(r) for r in a.rows.split(",")):
            for t in (int(x) for x in a.threads.split(",")):
                torch.set_num_threads(t)
                native().set_threads(t)
                ref, ker = step(shapes, rows, False), step(shapes, rows, True)
                rs: list[float] = []
                ks: list[float] = []
                for _ in range(a.repeats):
                    rs.append(timed(ref, a.min_s, clock))
                    ks.append(timed(ker, a.min_s, clock))
                r, k = statistics.median(rs), statistics.median(ks)
                print(f"{name:8} {rows:5d} {t:3d} {r:12.3f} {k:10.3f} {r / k:6.2f}", flush=True)


if __name__ == "__main__":
    main()
