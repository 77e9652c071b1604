"""Paged KV cache and batched varlen attention over it (SPEC T3, T4).

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

Attention runs in a few :class:`AttentionGroup` calls, never one per sequence (T4):

* **decode rows** (``q_b == 1``) attend with one query each: ``[G, H, 1, d]`` against their keys
  gathered block by block, a length mask only where contexts differ. They are split by key
  length (a small dynamic programme over a geometric grid of block counts) so that one long
  context does not pad every short one: a split costs one more call per layer, worth about
  ``_GROUP_OVERHEAD_KEYS`` padded key rows (measured on CPU).
* **prefill rows** (``q_b > 1``) form one group padded to ``[G, Q_max]`` queries, with a mask that
  lets a query at position ``p`` see keys at positions ``<= p`` of its own sequence only (causal
  within the chunk, full over the cached prefix); a lone fresh prompt uses ``is_causal``.

Each group's outputs are scattered back to flat token order. This module never imports
``coda.engine``.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# NOTE: one more attention call per layer (gather K, gather V, SDPA, scatter) costs about as
# much as this many padded key rows (measured: ~40 µs vs ~0.08 µs per key row, 1 CPU thread).
_GROUP_OVERHEAD_KEYS = 512
# NOTE: block counts are rounded up to this ×1.25 grid before grouping, so the programme below
# sees at most ~30 distinct lengths even for 64k-token contexts.
_GRID: tuple[int, ...] = tuple(sorted({int(1.25**i + 0.999) for i in range(80)}))


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended together in one SDPA call: ``num_seqs`` × ``query_len`` query rows
    (padded) against ``key_len`` keys gathered from ``num_blocks`` blocks per sequence."""

    num_seqs: int
    query_len: int
    num_blocks: int
    key_len: int
    block_index: torch.Tensor  # LongTensor[G * num_blocks]: the block tables, padded with 0
    query_index: torch.Tensor | None  # LongTensor[G * Q]: flat token per row; None = all T in order
    attn_mask: torch.Tensor | None  # BoolTensor[G, 1, Q, key_len] (True = may attend) or None
    is_causal: bool  # NOTE: only for one fresh chunk (ctx == q), where causal == the mask
    real_rows: torch.Tensor | None  # LongTensor[n]: non-padding rows of [G * Q]; None = all
    out_tokens: torch.Tensor | None  # LongTensor[n]: flat token of each real row


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
        groups: list[AttentionGroup] = []
        if decode:
            split = _split_by_length([context_lens[b] for b in decode], bs)
            whole = len(split) == 1 and not prefill  # NOTE: then the rows are flat tokens 0..T-1
            for part in split:
                rows = [decode[i] for i in part]
                groups.append(_decode_group(rows, starts, context_lens, block_tables, bs,
                                            device, whole))
        if prefill:
            groups.append(_prefill_group(prefill, starts, query_lens, context_lens,
                                         block_tables, bs, device, not decode))
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


def _split_by_length(ctx: list[int], bs: int) -> list[list[int]]:
    """Partition indices of ``ctx`` into groups of similar length (contiguous in sorted order),
    minimising padded key rows + ``_GROUP_OVERHEAD_KEYS`` per group. One group keeps the
    original order; several are sorted by length."""
    order = sorted(range(len(ctx)), key=ctx.__getitem__)
    buckets: list[tuple[int, list[int]]] = []  # (grid block count, indices)
    for i in order:
        size = _GRID[bisect_left(_GRID, -(-ctx[i] // bs))]
        if buckets and buckets[-1][0] == size:
            buckets[-1][1].append(i)
        else:
            buckets.append((size, [i]))
    if len(buckets) == 1:
        return [list(range(len(ctx)))]
    k = len(buckets)
    best = [0.0] + [float("inf")] * k
    cut = [0] * (k + 1)
    for j in range(1, k + 1):
        width, count = buckets[j - 1][0] * bs, 0
        for i in range(j, 0, -1):  # NOTE: buckets i..j (1-based) as one group of width j's
            count += len(buckets[i - 1][1])
            cost = best[i - 1] + count * width + _GROUP_OVERHEAD_KEYS
            if cost < best[j]:
                best[j], cut[j] = cost, i
    parts: list[list[int]] = []
    j = k
    while j > 0:
        parts.append([x for _, idx in buckets[cut[j] - 1 : j] for x in idx])
        j = cut[j] - 1
    return parts[::-1] if len(parts) > 1 else [list(range(len(ctx)))]


def _table_index(rows: list[int], tables: Sequence[Sequence[int]], n_blocks: int,
                 device: torch.device | str) -> torch.Tensor:
    flat: list[int] = []
    for b in rows:
        used = tables[b][:n_blocks]
        flat.extend(used)
        flat.extend([0] * (n_blocks - len(used)))  # NOTE: block 0 padding is masked out
    return torch.tensor(flat, dtype=torch.long, device=device)


def _decode_group(rows: list[int], starts: list[int], context_lens: Sequence[int],
                  tables: Sequence[Sequence[int]], bs: int, device: torch.device | str,
                  whole: bool) -> AttentionGroup:
    ctx = [context_lens[b] for b in rows]
    key_len = max(ctx)
    n_blocks = -(-key_len // bs)
    mask = None
    if min(ctx) != key_len:
        ctx_t = torch.tensor(ctx, dtype=torch.long)
        mask = (torch.arange(key_len)[None, :] < ctx_t[:, None]).view(len(rows), 1, 1, key_len)
        mask = mask.to(device)
    tokens = None if whole else torch.tensor([starts[b] for b in rows], device=device)
    return AttentionGroup(len(rows), 1, n_blocks, key_len, _table_index(rows, tables, n_blocks, device),
                          tokens, mask, False, None, tokens)


def _prefill_group(rows: list[int], starts: list[int], query_lens: Sequence[int],
                   context_lens: Sequence[int], tables: Sequence[Sequence[int]], bs: int,
                   device: torch.device | str, alone: bool) -> AttentionGroup:
    q = torch.tensor([query_lens[b] for b in rows], dtype=torch.long)
    ctx = torch.tensor([context_lens[b] for b in rows], dtype=torch.long)
    q_max, key_len = int(q.max()), int(ctx.max())
    n_blocks = -(-key_len // bs)
    index = _table_index(rows, tables, n_blocks, device)
    if len(rows) == 1:
        start = starts[rows[0]]
        tokens = None if alone else torch.arange(start, start + q_max, device=device)
        if key_len == q_max:  # NOTE: a fresh chunk: queries and keys are the same positions
            return AttentionGroup(1, q_max, n_blocks, key_len, index, tokens, None, True,
                                  None, tokens)
    # NOTE: padded query rows repeat the chunk's last token, so no mask row is all-False
    # (an all-masked softmax row would be NaN); real_rows drops them afterwards.
    offset = torch.minimum(torch.arange(q_max)[None, :], q[:, None] - 1)  # [G, Q]
    query_index = torch.tensor([starts[b] for b in rows])[:, None] + offset
    pos = (ctx - q)[:, None] + offset
    mask = (torch.arange(key_len)[None, None, :] <= pos[:, :, None]).unsqueeze(1)
    real = (torch.arange(q_max)[None, :] < q[:, None]).flatten().nonzero().flatten()
    flat = query_index.flatten()
    return AttentionGroup(len(rows), q_max, n_blocks, key_len, index, flat.to(device),
                          mask.to(device), False, real.to(device), flat[real].to(device))


class PagedKVCache:
    """Per-layer K and V tensors shaped ``[num_blocks, block_size, H_kv, d_h]``.

    Zero-initialised: slots not yet written are masked out, and masked values must be finite
    (a masked NaN would still poison ``softmax @ V``).
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
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
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
    """One group's attention: padded output rows ``[G * Q, H * d]``."""
    _, n_heads, head_dim = q.shape
    _, bs, n_kv, _ = k_cache.shape
    width = g.num_blocks * bs
    # NOTE: index_select on whole blocks is ~3x faster than advanced indexing on CPU; the view
    # puts each sequence's keys in logical order (T4) and the slice drops the padding past key_len.
    keys = k_cache.index_select(0, g.block_index).view(g.num_seqs, width, n_kv, head_dim)
    vals = v_cache.index_select(0, g.block_index).view(g.num_seqs, width, n_kv, head_dim)
    keys, vals = keys[:, : g.key_len].transpose(1, 2), vals[:, : g.key_len].transpose(1, 2)
    rows = q if g.query_index is None else q.index_select(0, g.query_index)
    queries = rows.view(g.num_seqs, g.query_len, n_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, keys, vals, attn_mask=g.attn_mask, is_causal=g.is_causal,
        enable_gqa=n_kv != n_heads,
    )
    return out.transpose(1, 2).reshape(g.num_seqs * g.query_len, n_heads * head_dim)


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
    k_cache.view(-1, n_kv, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, n_kv, head_dim).index_copy_(0, meta.slot_mapping, v)
    groups = meta.groups
    if len(groups) == 1 and groups[0].query_index is None:
        return _attend(q, k_cache, v_cache, groups[0])
    out = q.new_empty((n_tok, n_heads * head_dim))
    for g in groups:  # NOTE: a handful of groups per step, never one per sequence
        res = _attend(q, k_cache, v_cache, g)
        if g.real_rows is not None:
            res = res.index_select(0, g.real_rows)
        assert g.out_tokens is not None
        out.index_copy_(0, g.out_tokens, res)
    return out
