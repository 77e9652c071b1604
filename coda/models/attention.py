"""Paged KV cache and batch-invariant attention over it (SPEC T3, T4).

The step's layout and its metadata are described in ``attention_meta.py``. Attention is at most
one call for the decode rows and one pass over query blocks for the prefill rows per layer.
Both run the same batch-invariant arithmetic (T4: a query row's output is a function of its own
query and its own keys only — never of its neighbours, of the padding, of the group it lands
in, or of whether its token is prefilled or decoded). For a row at position ``p`` whose own
split is ``j = p // split``:

1. ``q`` is scaled by ``1/sqrt(d)``; per key split ``s <= j``, scores ``q·k`` come from one
   matmul of fixed inner shape (``[M, d] @ [d, split]``), keys after ``p`` masked to ``-inf``;
2. ``m`` = the row's max score over its splits (a max is exact in any order),
   ``P = exp(scores - m)`` (masked keys give exactly 0);
3. per split, ``[P·V | ΣP]`` by a fixed-shape matmul and a fixed-length sum;
4. the split partials are added LEFT TO RIGHT in float32: ``((x_0 + x_1) + x_2) + … + x_j``;
   decode rows run over the batch's longest key range, with splits after ``j`` replaced by
   ``-0.0`` (``x + -0.0 == x`` bit for bit, for every float ``x``);
5. out = numerator / denominator.

Matmul rows: MKL's float32 gemm gives a row the same bits for every row count ``M >= 4`` at
these shapes, but a different kernel (other bits) below 4; so a head group's rows are padded
with zero rows up to :data:`_MIN_ROWS` (tests/test_batch_invariance.py checks it at the real
model's dims). Scores and softmax run in float32 whatever the cache dtype. This module never
imports ``coda.engine``.

``AttentionMetadata(invariant=False)`` selects plain ``F.scaled_dot_product_attention`` over
the same gathered keys instead: the non-invariant baseline (``benchmarks/bench_attention.py``).
"""

from __future__ import annotations

import math
import mmap
import sys
from typing import Any

import torch
import torch.nn.functional as F

from coda.models.attention_meta import (
    AttentionMetadata,
    DecodeRows,
    PrefillBlock,
    PrefillRows,
    split_size,
)
from coda.models.attention_window import WindowMasks
from coda.models.config import ModelConfig
from coda.models.kernels import ops, unavailable

__all__ = ["AttentionMetadata", "PagedKVCache", "attend_native", "native_attention_refusal",
           "paged_attention", "split_size"]

# NOTE: the fewest rows a gemm sees (see the module docstring).
_MIN_ROWS = 4


class PagedKVCache:
    """Per-layer K and V tensors shaped ``[H_kv, num_blocks, block_size, d_h]``, side by side
    in ``layers[i]`` = ``[2, H_kv, num_blocks, block_size, d_h]`` (one gather reads both).

    Head-major, so the keys gathered for a group view as ``[H_kv, G, keys, d_h]`` without a
    copy and feed one batched matmul. Zero-initialised: slots not yet written are masked out,
    and masked values must be finite (a masked NaN would still poison ``softmax @ V``).

    On the CPU the storage is a fresh anonymous mapping (issue 19 item 3): the kernel's zero
    pages, committed on first write, so ``nbytes`` is reserved, not resident; blocks handed
    out lowest id first (``BlockManager``) keep the committed part at the start of each plane.
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
        self._storage = _zeros_uncommitted(shape, dtype, torch.device(device))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.layers: list[torch.Tensor] = [self._storage[i] for i in range(num_layers)]
        self.k: list[torch.Tensor] = [self._storage[i, 0] for i in range(num_layers)]
        self.v: list[torch.Tensor] = [self._storage[i, 1] for i in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return self._storage.numel() * self._storage.element_size()


def _zeros_uncommitted(shape: tuple[int, ...], dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    """Zeros of ``shape``; on the CPU mapped without committing a page (see PagedKVCache)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    # NOTE: MAP_NORESERVE (0x4000 on Linux; absent from Python's mmap module before 3.13):
    # the reservation is not charged against overcommit; pages are committed as written
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
    buf = mmap.mmap(-1, max(nbytes, 1), flags=flags)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        # NOTE: with THP "always" one written slot would commit a 2 MiB page per K/V plane
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    # NOTE: the tensor holds the mapping alive (frombuffer keeps a reference to ``buf``)
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


def _gather(kv_layer: torch.Tensor, index: torch.Tensor, n_seqs: int,
            key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks ``index`` of one layer's ``[2, H_kv, blocks, bs, d]`` cache, K and V in one copy,
    as float32 ``[H_kv, G, key_len, d]`` each."""
    two, n_kv, _, _, d = kv_layer.shape
    both = kv_layer.view(two * n_kv, *kv_layer.shape[2:]).index_select(1, index)
    if both.dtype != torch.float32:
        both = both.float()
    kv = both.view(two, n_kv, n_seqs, key_len, d)
    return kv[0], kv[1]


def _rows(q: torch.Tensor, n_kv: int, n_seqs: int, n_tok: int) -> torch.Tensor:
    """Queries ``[G * R, H, d]`` as ``[H_kv, G, M, d]``: the R tokens × H/H_kv heads that share
    a KV head, zero rows added up to :data:`_MIN_ROWS`."""
    _, n_heads, d = q.shape
    per_kv = n_heads // n_kv  # NOTE: query head h reads kv head h // per_kv (HF's repeat_kv)
    rows = n_tok * per_kv
    qs = q.view(n_seqs, n_tok, n_kv, per_kv, d).permute(2, 0, 1, 3, 4).reshape(n_kv, n_seqs,
                                                                               rows, d)
    if rows < _MIN_ROWS:
        qs = torch.cat((qs, qs.new_zeros(n_kv, n_seqs, _MIN_ROWS - rows, d)), dim=2)
    return qs


def _partials(qs: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, split: int,
              hidden: torch.Tensor | None, diag_hidden: torch.Tensor | None,
              per_kv: int, row_hidden: torch.Tensor | None = None) -> torch.Tensor:
    """Steps 1–3 over ``S = keys / split`` splits: ``[H_kv, G, S, M, d + 1]`` = ``[P·V | ΣP]``.

    ``qs`` [H_kv, G, M, d]; ``keys``/``vals`` [H_kv, G, S * split, d]. ``hidden`` masks keys
    for all rows (``[1, G, 1, S * split]``); ``diag_hidden`` masks the last split's keys per
    token (``[1, G, R, 1, split]``); ``row_hidden`` masks any key per token (``[1, G, R, 1, S *
    split]``, a local layer's window, ``attention_window.py``). Scores are ONE matmul over all the keys: a score is a dot
    product over ``d`` whose bits do not depend on the number of keys (checked by the tests);
    ``P·V`` must be per split (its reduction runs over keys)."""
    n_kv, n_seqs, m, d = qs.shape
    scores = torch.matmul(qs, keys.transpose(-1, -2))  # [H_kv, G, M, S * split]
    if hidden is not None:
        scores.masked_fill_(hidden, -math.inf)
    if diag_hidden is not None:
        n_tok = diag_hidden.shape[2]
        # NOTE: a view of the last split's real rows as [R, per_kv]: masked in place
        diag = scores[:, :, : n_tok * per_kv, -split:].view(n_kv, n_seqs, n_tok, per_kv, split)
        diag.masked_fill_(diag_hidden, -math.inf)
    if row_hidden is not None:
        n_tok = row_hidden.shape[2]
        scores[:, :, : n_tok * per_kv].view(n_kv, n_seqs, n_tok, per_kv, -1).masked_fill_(
            row_hidden, -math.inf)
    probs = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    n_splits = scores.shape[-1] // split
    by_split = probs.view(n_kv, n_seqs, m, n_splits, split).transpose(2, 3)  # [H_kv,G,S,M,split]
    numer = torch.matmul(by_split, vals.view(n_kv, n_seqs, n_splits, split, d))
    return torch.cat((numer, by_split.sum(-1, keepdim=True)), dim=-1)


def _combine(parts: torch.Tensor) -> torch.Tensor:
    """Steps 4–5: left-to-right float32 sum over the split axis (dim 2), then divide."""
    acc = parts[:, :, 0]
    for s in range(1, parts.shape[2]):  # NOTE: S is small: 8 splits at 512 keys
        acc = acc + parts[:, :, s]  # NOTE: never torch.sum: its order is not specified
    return acc[..., :-1] / acc[..., -1:]


def _heads_out(res: torch.Tensor, n_seqs: int, n_tok: int, n_heads: int) -> torch.Tensor:
    """``[H_kv, G, M, d]`` -> ``[G * R, H * d]`` (padding rows dropped)."""
    n_kv, _, _, d = res.shape
    per_kv = n_heads // n_kv
    res = res[:, :, : n_tok * per_kv].reshape(n_kv, n_seqs, n_tok, per_kv, d)
    return res.permute(1, 2, 0, 3, 4).reshape(n_seqs * n_tok, n_heads * d)


def _attend_decode(q: torch.Tensor, kv_layer: torch.Tensor, g: DecodeRows,
                   win: WindowMasks | None = None) -> torch.Tensor:
    """All decode rows ``[G, H * d]`` (in ``g.tokens`` order)."""
    n_kv = kv_layer.shape[1]
    keys, vals = _gather(kv_layer, g.block_index, g.num_seqs, g.num_splits * g.split)
    picked = q if g.tokens is None else q.index_select(0, g.tokens)
    hidden = g.hidden if win is None or win.decode_hidden is None else win.decode_hidden
    parts = _partials(_rows(picked, n_kv, g.num_seqs, 1), keys, vals, g.split, hidden, None, 0)
    if g.dead is not None:
        parts.masked_fill_(g.dead, -0.0)  # NOTE: x + -0.0 == x exactly: splits after j vanish
    return _heads_out(_combine(parts), g.num_seqs, 1, q.shape[1])


def _attend_block(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, split: int,
                  blk: PrefillBlock, row_hidden: torch.Tensor | None) -> torch.Tensor:
    """One prefill query block ``[G_j * R, H * d]``: key splits ``0..j`` of its sequences."""
    n_kv, n_heads = keys.shape[0], q.shape[1]
    if blk.seqs is not None:
        keys, vals = keys.index_select(1, blk.seqs), vals.index_select(1, blk.seqs)
    n_keys = (blk.split_index + 1) * split
    keys, vals = keys[:, :, :n_keys], vals[:, :, :n_keys]
    n_seqs = keys.shape[1]
    qs = _rows(q.index_select(0, blk.tokens), n_kv, n_seqs, blk.rows)
    parts = _partials(qs, keys, vals, split, None, blk.diag_hidden, n_heads // n_kv, row_hidden)
    return _heads_out(_combine(parts), n_seqs, blk.rows, n_heads)


def _attend_prefill(q: torch.Tensor, kv_layer: torch.Tensor, g: PrefillRows,
                    out: torch.Tensor, win: WindowMasks | None) -> None:
    keys, vals = _gather(kv_layer, g.block_index, g.num_seqs, g.num_splits * g.split)
    for i, blk in enumerate(g.blocks):
        res = _attend_block(q, keys, vals, g.split, blk,
                            None if win is None or not win.block_hidden else win.block_hidden[i])
        if blk.real is not None:
            res = res.index_select(0, blk.real)
        out.index_copy_(0, blk.out_tokens, res.to(out.dtype))


def _sdpa(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor,
          visible: torch.Tensor) -> torch.Tensor:
    """Non-invariant baseline: ``q`` [G, Q, H, d], keys/vals [H_kv, G, L, d]."""
    n_seqs = keys.shape[1]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(0, 1),
                                         vals.transpose(0, 1), attn_mask=visible,
                                         scale=1.0, enable_gqa=True)  # NOTE: q is prescaled
    return out.transpose(1, 2).reshape(n_seqs * q.shape[1], -1)


def _attend_sdpa(q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata,
                 out: torch.Tensor, win: WindowMasks | None) -> None:
    n_heads, d = q.shape[1], q.shape[2]
    if (g := meta.decode) is not None:
        keys, vals = _gather(kv_layer, g.block_index, g.num_seqs, g.num_splits * g.split)
        picked = q if g.tokens is None else q.index_select(0, g.tokens)
        vis = (g.visible if win is None or win.decode_visible is None else win.decode_visible
               ).view(g.num_seqs, 1, 1, -1)  # NOTE: True = attend
        res = _sdpa(picked.view(g.num_seqs, 1, n_heads, d), keys, vals, vis)
        _place(out, res, g.tokens)
    if (p := meta.prefill) is not None:
        assert p.dense_tokens is not None and p.dense_visible is not None
        keys, vals = _gather(kv_layer, p.block_index, p.num_seqs, p.num_splits * p.split)
        picked = q.index_select(0, p.dense_tokens).view(p.num_seqs, -1, n_heads, d)
        res = _sdpa(picked, keys, vals, p.dense_visible if win is None or
                    win.dense_visible is None else win.dense_visible)
        assert p.dense_real is not None and p.dense_out is not None
        out.index_copy_(0, p.dense_out, res.index_select(0, p.dense_real).to(out.dtype))


def _place(out: torch.Tensor, res: torch.Tensor, tokens: torch.Tensor | None) -> None:
    if tokens is None:
        out[: res.shape[0]] = res
    else:
        out.index_copy_(0, tokens, res.to(out.dtype))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None = None,
    window: WindowMasks | None = None,
) -> torch.Tensor:
    """Write the new K/V at their slots, then attend. ``q``: [T, H, d]; ``k``/``v``: [T, H_kv, d];
    ``kv_layer``: one layer's cache ``[2, H_kv, blocks, block_size, d]`` (K, then V); ``scale``
    multiplies ``q`` (default ``1/sqrt(d)``); ``window``: a local layer's sliding-window masks
    (``attention_window.py``; None: full causal attention).

    Returns [T, H * d] in flat token order.
    """
    n_tok, n_heads, head_dim = q.shape
    n_kv = k.shape[1]
    flat = kv_layer.view(2, n_kv, -1, head_dim)
    same = kv_layer.dtype == k.dtype  # NOTE: skip no-op casts: each is a dispatch per layer
    flat[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1) if same else
                        k.transpose(0, 1).to(kv_layer.dtype))
    flat[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1) if same else
                        v.transpose(0, 1).to(kv_layer.dtype))
    qs = (q if q.dtype == torch.float32 else q.float()) * (
        1.0 / math.sqrt(head_dim) if scale is None else scale)
    dec = meta.decode
    if meta.invariant and meta.prefill is None and dec is not None and dec.tokens is None:
        res = _attend_decode(qs, kv_layer, dec, window)  # NOTE: a decode-only step
        return res if res.dtype == q.dtype else res.to(q.dtype)
    out = q.new_empty((n_tok, n_heads * head_dim))
    if not meta.invariant:
        _attend_sdpa(qs, kv_layer, meta, out, window)
    else:
        if dec is not None:
            _place(out, _attend_decode(qs, kv_layer, dec, window), dec.tokens)
        if meta.prefill is not None:
            _attend_prefill(qs, kv_layer, meta.prefill, out, window)
    return out


def native_attention_refusal(cfg: ModelConfig, kv_dtype: torch.dtype,
                             device: torch.device) -> str | None:
    """Why the native kernel (``kernels/csrc/rows.h``) cannot run this model's attention
    (None: it can). It runs per-head q/k norms (Qwen3, Gemma 3), sliding-window layers, the
    SiLU or GELU-tanh gate and Gemma's sandwich norms; it reads a float32 CPU cache; it needs
    ``head_dim`` in 32/64/96/128/256; and it must build here."""
    if cfg.hidden_act not in ("silu", "gelu_tanh"):
        return f"the {cfg.hidden_act} gate has no native kernel"
    if cfg.rope_dim != cfg.head_dim:
        # NOTE: the kernel can rotate part of a head, but the model does not pass it the
        # rotary width yet (Phi-4-mini): its attention stays in Python until it does
        return f"partial rotary ({cfg.rope_dim} of {cfg.head_dim} dimensions) runs in Python"
    if kv_dtype != torch.float32 or device.type != "cpu":
        return f"the KV cache is {kv_dtype} on {device.type} (the kernel reads float32 on CPU)"
    if cfg.head_dim not in (32, 64, 96, 128, 256) or cfg.num_heads % cfg.num_kv_heads or \
            cfg.num_heads // cfg.num_kv_heads > 16:
        return f"head shape {cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim} unsupported"
    return unavailable()


def attend_native(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kv_layer: torch.Tensor, meta: AttentionMetadata, n_heads: int,
                  n_kv: int, **options: Any) -> torch.Tensor:
    """The fused projection's output ``qkv`` [T, (H + 2 H_kv) d] -> attention output [T, H d]:
    RoPE (the same bits as :func:`~coda.models.llama.apply_rope`), the K/V cache write at
    ``meta.slot_mapping``, and each row's attention over its own keys in one fixed order (T4;
    ``kernels/csrc/rows.h``). Needs ``meta.rows`` (``AttentionMetadata.build(kernel=True)``).
    ``options``: :func:`coda.models.kernels.ops.attend`'s (window, scale, q/k norms, eps)."""
    rows = meta.rows
    assert rows is not None
    return ops.attend(
        qkv, cos, sin, kv_layer, meta.slot_mapping, rows.seq_of, meta.positions, rows.tables,
        n_heads, n_kv, **options)
