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
flat slot (``block * block_size + offset``) for each new token. Attention is computed on a
padded ``[B, Q_max]`` view of the queries against each sequence's gathered keys, with a mask
that lets a query at position ``p`` see keys at positions ``<= p`` of its own sequence only
(causal within the chunk, full over the cached prefix). No Python loop over sequences runs in
the forward; this module never imports ``coda.engine``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token sits, and what each query may see, for one forward step."""

    query_start: torch.Tensor  # LongTensor[B]: first flat index of sequence b's chunk
    query_lens: torch.Tensor  # LongTensor[B]
    context_lens: torch.Tensor  # LongTensor[B]: cache length after this step
    block_tables: torch.Tensor  # LongTensor[B, n_blocks], padded with block 0 (masked out)
    slot_mapping: torch.Tensor  # LongTensor[T]: flat cache slot of each new token's K/V
    positions: torch.Tensor  # LongTensor[T]: logical position of each new token
    pad_index: torch.Tensor  # LongTensor[B, Q_max]: flat index of query i of seq b (clamped)
    unpad_index: torch.Tensor  # LongTensor[T]: row b*Q_max + i of flat token t
    attn_mask: torch.Tensor  # BoolTensor[B, 1, Q_max, n_blocks*block_size]: True = may attend

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
        """Build the step's tensors from per-sequence Python lists (vectorised in torch).

        ``block_tables[b]`` must cover positions ``[0, context_lens[b])``. Raises ValueError
        on an empty chunk, a chunk longer than its context, or a table that is too short.
        """
        n = len(query_lens)
        if n == 0 or n != len(context_lens) or n != len(block_tables):
            raise ValueError("need one query_len, context_len and block table per sequence")
        for q_len, ctx, row in zip(query_lens, context_lens, block_tables, strict=True):
            if not 1 <= q_len <= ctx:
                raise ValueError(f"need 1 <= query_len ({q_len}) <= context_len ({ctx})")
            if len(row) * block_size < ctx:
                raise ValueError(
                    f"block table of {len(row)} blocks cannot hold {ctx} tokens "
                    f"(block_size={block_size})"
                )
        q = torch.tensor(list(query_lens), dtype=torch.long)
        ctx_t = torch.tensor(list(context_lens), dtype=torch.long)
        n_blocks = (int(ctx_t.max()) + block_size - 1) // block_size
        table = torch.zeros((n, n_blocks), dtype=torch.long)
        for b, row in enumerate(block_tables):
            used = list(row[:n_blocks])
            table[b, : len(used)] = torch.tensor(used, dtype=torch.long)
        starts = torch.cumsum(q, 0) - q
        seq_of_tok = torch.repeat_interleave(torch.arange(n), q)
        offset = torch.arange(int(q.sum())) - starts[seq_of_tok]
        positions = (ctx_t - q)[seq_of_tok] + offset
        slots = table[seq_of_tok, positions // block_size] * block_size + positions % block_size
        q_max = int(q.max())
        # NOTE: padded query rows repeat the chunk's last token, so no mask row is all-False
        # (an all-masked softmax row would be NaN); their outputs are dropped by unpad_index.
        pad_index = starts[:, None] + torch.minimum(torch.arange(q_max)[None, :], q[:, None] - 1)
        key_pos = torch.arange(n_blocks * block_size)
        mask = key_pos[None, None, :] <= positions[pad_index][:, :, None]
        return cls(
            query_start=starts.to(device),
            query_lens=q.to(device),
            context_lens=ctx_t.to(device),
            block_tables=table.to(device),
            slot_mapping=slots.to(device),
            positions=positions.to(device),
            pad_index=pad_index.to(device),
            unpad_index=(seq_of_tok * q_max + offset).to(device),
            attn_mask=mask.unsqueeze(1).to(device),
        )


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
    n_seq, q_max = meta.pad_index.shape
    # [B, n_blocks, bs, H_kv, d] -> [B, H_kv, K, d]: each sequence's keys in logical order (T4)
    keys = k_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)
    vals = v_cache[meta.block_tables].flatten(1, 2).transpose(1, 2)
    queries = q[meta.pad_index].transpose(1, 2)  # [B, H, Q_max, d]
    out = F.scaled_dot_product_attention(
        queries, keys, vals, attn_mask=meta.attn_mask, enable_gqa=n_kv != n_heads
    )
    out = out.transpose(1, 2).reshape(n_seq * q_max, n_heads * head_dim)
    return out[meta.unpad_index]
