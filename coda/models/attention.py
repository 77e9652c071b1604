"""Paged KV cache and batch-invariant varlen attention over it (SPEC T3, T4).

A step's batch is FLATTENED: the new tokens of every sequence are concatenated, grouped by
sequence, in batch order. Each sequence brings a chunk of ``q_b`` new tokens (a prefill chunk
or one decode token) on top of ``ctx_b - q_b`` tokens already in its cache::

    flat token t:    0  1  2 | 3 | 4  5        (B = 3 sequences, T = 6 tokens)
    seq of t:        0  0  0 | 1 | 2  2
    query_lens:      3         1   2
    context_lens:    3         9   6          (cache length AFTER this step)
    positions:       0  1  2 | 8 | 4  5        ctx_b - q_b + i

The cache is paged: logical position ``p`` of sequence ``b`` lives in physical block
``block_tables[b, p // block_size]`` at offset ``p % block_size``; ``slot_mapping[t]`` is that
flat slot (``block * block_size + offset``) for each new token.

Attention is at most TWO calls per layer, whatever the mix of lengths: every decode row
(``q_b == 1``) in one :class:`AttentionGroup`, every prefill row in another (padded to the
longest chunk). Both run the same batch-invariant algorithm (T4: a query row's output is a
function of its own query and its own keys only — never of its neighbours, of the padding, of
the group it lands in, or of whether its token is prefilled or decoded):

1. scores ``q·k`` for every key slot (one matmul whose reduction is over ``head_dim`` only);
   keys after the row's position are masked to ``-inf``;
2. ``m`` = the row's max score (a max is exact in any order), ``p = exp(s - m)``;
3. the keys are cut into fixed splits of :data:`split_size` keys counted from position 0; each
   split is reduced by a fixed-shape matmul (``p @ V``) and a fixed-length sum (``Σp``);
4. the splits are combined by ``cumsum`` (a sequential scan: the value at split ``j`` depends on
   splits ``0..j`` only) and read at the row's own last split.

So padding keys, padding splits and padding rows never touch a real row's arithmetic, and a
token computed in prefill gets exactly the K/V and output it would get in decode (preemption
by recompute and prefix-cache hits change nothing). Scores and softmax run in float32 whatever
the cache dtype. This module never imports ``coda.engine``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# NOTE: keys per split. Any fixed value keeps T4; 64 keeps the per-split matmul reasonably
# sized while wasting at most 63 masked key slots per row.
_SPLIT_KEYS = 64


def split_size(block_size: int) -> int:
    """Keys per attention split: a whole number of blocks, at least :data:`_SPLIT_KEYS`."""
    return block_size * -(-_SPLIT_KEYS // block_size)


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together in one call: ``num_seqs`` × ``query_len`` query rows
    (padded) against ``num_splits`` × ``split`` key slots gathered block by block."""

    num_seqs: int
    query_len: int
    num_splits: int
    split: int
    block_index: torch.Tensor  # LongTensor[G * num_splits * split / bs]: tables, padded with 0
    query_index: torch.Tensor | None  # LongTensor[G * Q]: flat token per row; None = all T in order
    visible: torch.Tensor  # BoolTensor[1, G, S, Q, 1, split]: key slot <= row position
    last_split: torch.Tensor  # LongTensor[G, Q]: the split holding each row's own position
    real_rows: torch.Tensor | None  # LongTensor[n]: non-padding rows of [G * Q]; None = all
    out_tokens: torch.Tensor | None  # LongTensor[n]: flat token of each real row

    @property
    def key_len(self) -> int:
        return self.num_splits * self.split


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token sits, and what each query may see, for one forward step."""

    slot_mapping: torch.Tensor  # LongTensor[T]: flat cache slot of each new token's K/V
    positions: torch.Tensor  # LongTensor[T]: logical position of each new token
    groups: tuple[AttentionGroup, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the step's tensors from per-sequence Python lists.

        ``block_tables[b]`` must cover positions ``[0, context_lens[b])``. Raises ValueError
        on an empty chunk, a chunk longer than its context, or a table that is too short.
        """
        n = len(query_lens)
        if n == 0 or n != len(context_lens) or n != len(block_tables):
            raise ValueError("need one query_len, context_len and block table per sequence")
        bs = block_size
        positions: list[int] = []
        slots: list[int] = []
        starts: list[int] = []
        decode: list[int] = []
        prefill: list[int] = []
        for b in range(n):
            q_len, ctx, row = query_lens[b], context_lens[b], block_tables[b]
            if not 1 <= q_len <= ctx:
                raise ValueError(f"need 1 <= query_len ({q_len}) <= context_len ({ctx})")
            if len(row) * bs < ctx:
                raise ValueError(
                    f"block table of {len(row)} blocks cannot hold {ctx} tokens (block_size={bs})"
                )
            starts.append(len(positions))
            if q_len == 1:
                decode.append(b)
                positions.append(ctx - 1)
                slots.append(row[(ctx - 1) // bs] * bs + (ctx - 1) % bs)
            else:
                prefill.append(b)
                positions.extend(range(ctx - q_len, ctx))
                _extend_slots(slots, row, ctx - q_len, ctx, bs)
        groups = [
            _group(rows, starts, query_lens, context_lens, block_tables, bs, device,
                   in_order=len(rows) == n)
            for rows in (decode, prefill) if rows
        ]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            groups=tuple(groups),
        )


def _extend_slots(slots: list[int], row: Sequence[int], start: int, end: int, bs: int) -> None:
    """Append the flat slots of positions ``[start, end)``, one ``range`` per block."""
    for j in range(start // bs, (end - 1) // bs + 1):
        lo, hi = max(start, j * bs), min(end, (j + 1) * bs)
        base = row[j] * bs - j * bs
        slots.extend(range(base + lo, base + hi))


def _group(rows: list[int], starts: list[int], query_lens: Sequence[int],
           context_lens: Sequence[int], tables: Sequence[Sequence[int]], bs: int,
           device: torch.device | str, in_order: bool) -> AttentionGroup:
    """One group over sequences ``rows``; ``in_order``: they are all T flat tokens, in order."""
    split = split_size(bs)
    q = torch.tensor([query_lens[b] for b in rows], dtype=torch.long)
    ctx = torch.tensor([context_lens[b] for b in rows], dtype=torch.long)
    q_max = int(q.max())
    n_splits = -(-int(ctx.max()) // split)
    n_blocks = n_splits * (split // bs)
    flat_blocks: list[int] = []
    for b in rows:
        used = list(tables[b][:n_blocks])
        flat_blocks.extend(used)
        flat_blocks.extend([0] * (n_blocks - len(used)))  # NOTE: padding blocks are masked out
    # NOTE: padded query rows repeat the chunk's last token (a finite, visible row); real_rows
    # drops them afterwards.
    offset = torch.minimum(torch.arange(q_max)[None, :], q[:, None] - 1)  # [G, Q]
    pos = (ctx - q)[:, None] + offset
    visible = torch.arange(n_splits * split)[None, None, :] <= pos[:, :, None]
    flat = (torch.tensor([starts[b] for b in rows])[:, None] + offset).flatten()
    padded = q_max > 1 and bool((q < q_max).any())
    real = (torch.arange(q_max)[None, :] < q[:, None]).flatten().nonzero().flatten()
    return AttentionGroup(
        num_seqs=len(rows), query_len=q_max, num_splits=n_splits, split=split,
        block_index=torch.tensor(flat_blocks, dtype=torch.long, device=device),
        query_index=None if in_order and not padded else flat.to(device),
        visible=visible.view(len(rows), q_max, n_splits, 1, split).transpose(1, 2)[None].to(device),
        last_split=(pos // split).to(device),
        real_rows=real.to(device) if padded else None,
        out_tokens=None if in_order and not padded else flat[real].to(device),
    )  # fmt: skip


class PagedKVCache:
    """Per-layer K and V tensors shaped ``[H_kv, num_blocks, block_size, d_h]``.

    Head-major, so the keys gathered for a group view as ``[H_kv, G, keys, d_h]`` without a
    copy and feed one batched matmul. Zero-initialised: slots not yet written are masked out,
    and masked values must be finite (a masked NaN would still poison ``softmax @ V``).
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)
        self._storage = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.k: list[torch.Tensor] = [self._storage[i, 0] for i in range(num_layers)]
        self.v: list[torch.Tensor] = [self._storage[i, 1] for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            g: AttentionGroup) -> torch.Tensor:
    """One group's attention (the algorithm of the module docstring): rows ``[G * Q, H * d]``.

    Every matmul here has a fixed inner shape per split (``[rows, d] @ [d, split]`` and
    ``[rows, split] @ [split, d]``); only the number of matrices depends on the batch.
    """
    _, n_heads, d = q.shape
    n_kv = k_cache.shape[0]
    per_kv = n_heads // n_kv  # NOTE: query head h reads kv head h // per_kv (HF's repeat_kv)
    n_g, n_q, n_s, split = g.num_seqs, g.query_len, g.num_splits, g.split
    rows = n_q * per_kv
    shape = (n_kv, n_g, n_s, split, d)
    keys = k_cache.index_select(1, g.block_index).view(shape).float()
    vals = v_cache.index_select(1, g.block_index).view(shape).float()
    picked = q if g.query_index is None else q.index_select(0, g.query_index)
    qs = picked.view(n_g, n_q, n_kv, per_kv, d).permute(2, 0, 1, 3, 4).reshape(n_kv, n_g, 1, rows, d)
    # NOTE: scores [H_kv, G, S, rows, split]; the query is broadcast over the splits.
    scores = torch.matmul(qs.float(), keys.transpose(-1, -2)).mul_(1.0 / math.sqrt(d))
    scores = scores.view(n_kv, n_g, n_s, n_q, per_kv, split).masked_fill_(~g.visible, -math.inf)
    top = scores.amax(dim=(2, 5), keepdim=True)  # NOTE: a max is exact in any order
    probs = torch.exp(scores - top).view(n_kv, n_g, n_s, rows, split)  # masked -> exactly 0
    denom = probs.sum(-1).cumsum(2)  # [H_kv, G, S, rows]
    numer = torch.matmul(probs, vals).cumsum(2)  # [H_kv, G, S, rows, d]
    last = g.last_split.view(1, n_g, 1, n_q, 1)
    num = numer.view(n_kv, n_g, n_s, n_q, per_kv * d).gather(
        2, last.expand(n_kv, n_g, 1, n_q, per_kv * d)).view(n_kv, n_g, n_q, per_kv, d)
    den = denom.view(n_kv, n_g, n_s, n_q, per_kv).gather(
        2, last.expand(n_kv, n_g, 1, n_q, per_kv)).view(n_kv, n_g, n_q, per_kv, 1)
    out = (num / den).to(q.dtype)  # [H_kv, G, Q, per_kv, d]
    return out.permute(1, 2, 0, 3, 4).reshape(n_g * n_q, n_heads * d)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write the new K/V at their slots, then attend. ``q``: [T, H, d]; ``k``/``v``: [T, H_kv, d].

    Returns [T, H * d] in flat token order.
    """
    n_tok, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    k_cache.view(n_kv, -1, head_dim).index_copy_(1, meta.slot_mapping,
                                                 k.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(n_kv, -1, head_dim).index_copy_(1, meta.slot_mapping,
                                                 v.transpose(0, 1).to(v_cache.dtype))
    groups = meta.groups
    if len(groups) == 1 and groups[0].out_tokens is None:
        return _attend(q, k_cache, v_cache, groups[0])
    out = q.new_empty((n_tok, n_heads * head_dim))
    for g in groups:  # NOTE: at most two: the decode rows and the prefill rows
        res = _attend(q, k_cache, v_cache, g)
        if g.real_rows is not None:
            res = res.index_select(0, g.real_rows)
        assert g.out_tokens is not None
        out.index_copy_(0, g.out_tokens, res)
    return out
