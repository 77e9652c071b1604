"""A random paged schedule for attention T4 tests (tests/test_attention_invariance.py, the torch
path; tests/test_native_rows.py, the native kernel): many sequences advanced together in random
chunks over shuffled physical blocks, each row collected for comparison with the row alone."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from coda.models.attention import AttentionMetadata

# (the step's rows of each input, concatenated; the cache; the step's metadata) -> output rows
Step = Callable[[list[torch.Tensor], torch.Tensor, AttentionMetadata], torch.Tensor]


def schedule_rows(lengths: list[int], bs: int, rng: random.Random,
                  data: Sequence[tuple[torch.Tensor, ...]], cache: torch.Tensor, step: Step,
                  kernel: bool = False) -> list[torch.Tensor]:
    """Run every sequence ``i`` (its inputs ``data[i]``, ``lengths[i]`` rows each) through
    ``step`` in random chunks (prefill chunks and single decode tokens mixed in one step, in
    shuffled order) over shuffled physical blocks of ``cache``; returns each sequence's rows."""
    per_seq = [-(-n // bs) for n in lengths]
    phys = list(range(sum(per_seq)))
    rng.shuffle(phys)
    tables, at = [], 0
    for m in per_seq:
        tables.append(phys[at:at + m])
        at += m
    done = [0] * len(lengths)
    out: list[list[torch.Tensor]] = [[] for _ in lengths]
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        live = [i for i, n in enumerate(lengths) if done[i] < n]
        chosen = [i for i in live if rng.random() < 0.7] or live[:1]
        rng.shuffle(chosen)
        q_lens = [min(lengths[i] - done[i], rng.choice([1, 1, 2, 5, 64, 130])) for i in chosen]
        ctx = [done[i] + n for i, n in zip(chosen, q_lens, strict=True)]
        meta = AttentionMetadata.build(q_lens, ctx, [tables[i] for i in chosen], bs,
                                       kernel=kernel)
        inputs = [torch.cat([data[i][x][done[i]:c] for i, c in zip(chosen, ctx, strict=True)])
                  for x in range(len(data[chosen[0]]))]
        res = step(inputs, cache, meta)
        at = 0
        for i, n in zip(chosen, q_lens, strict=True):
            out[i].extend(res[at:at + n])
            at += n
            done[i] += n
    return [torch.stack(rows) for rows in out]
