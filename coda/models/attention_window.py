"""Sliding-window masks for local attention layers (Gemma 3; SPEC T3, T4).

A local layer's query at position ``p`` sees the keys at positions ``p - window + 1 .. p`` (its
own included), as transformers' ``sliding_window_overlay`` and llama.cpp's standard SWA do.
The KV cache keeps every key (a global layer reads them all); the window is one more mask on
top of the causal masks of :class:`~coda.models.attention_meta.AttentionMetadata`, built once
per step from the step's own metadata (so every path that builds metadata — prefill, decode,
chunked prefill, prefix-cache hits, mixed batches — gets it without being told) and shared
by every local layer of that step.

A mask depends only on its row's position and the key positions, never on the batch, so T4
holds as for the causal masks. Masked keys give an exact 0 in ``exp(score - max)``; a split
whose keys are all masked contributes ``[0 | 0]``. This module never imports ``coda.engine``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from coda.models.attention_meta import AttentionMetadata


@dataclass(frozen=True)
class WindowMasks:
    """One step's masks for the local layers (None where no key is outside the window).

    ``decode_hidden``/``decode_visible`` replace :class:`DecodeRows`' ``hidden``/``visible``;
    ``block_hidden[i]`` (``[1, G_j, R, 1, (j + 1) * split]``) hides, for prefill block ``i``,
    the keys before each row's window; ``dense_visible`` replaces ``PrefillRows.dense_visible``
    (the SDPA mode)."""

    window: int
    decode_hidden: torch.Tensor | None = None
    decode_visible: torch.Tensor | None = None
    block_hidden: tuple[torch.Tensor | None, ...] = ()
    dense_visible: torch.Tensor | None = None


def _too_old(pos: torch.Tensor, n_keys: int, window: int) -> torch.Tensor:
    """``[..., n_keys]``: key position ``k <= p - window`` for each row position ``p``."""
    keys = torch.arange(n_keys, device=pos.device)
    return keys <= (pos - window).unsqueeze(-1)


def window_masks(meta: AttentionMetadata, window: int) -> WindowMasks | None:
    """The local layers' masks for ``meta``'s step; None when no row's window cuts a key off
    (every position ``< window``), so short contexts pay nothing."""
    if window <= 0:
        raise ValueError(f"sliding window must be positive, got {window}")
    if meta.max_position < 0 and meta.positions.numel():
        top = int(meta.positions.max())
    else:
        top = meta.max_position
    if top < window:
        return None
    fields: dict[str, object] = {}
    if (g := meta.decode) is not None:
        pos = meta.positions[: g.num_seqs] if g.tokens is None else \
            meta.positions.index_select(0, g.tokens)
        old = _too_old(pos, g.hidden.shape[-1], window).view(g.hidden.shape)
        fields["decode_hidden"] = g.hidden | old
        fields["decode_visible"] = g.visible & ~old
    if (p := meta.prefill) is not None:
        masks: list[torch.Tensor | None] = []
        for blk in p.blocks:
            pos = meta.positions.index_select(0, blk.tokens).view(-1, blk.rows)
            if int(pos.max()) < window:
                masks.append(None)
                continue
            old = _too_old(pos, (blk.split_index + 1) * p.split, window)
            masks.append(old.view(1, pos.shape[0], blk.rows, 1, -1))
        fields["block_hidden"] = tuple(masks)
        if p.dense_tokens is not None and p.dense_visible is not None:
            pos = meta.positions.index_select(0, p.dense_tokens).view(p.num_seqs, -1)
            old = _too_old(pos, p.dense_visible.shape[-1], window)
            fields["dense_visible"] = p.dense_visible & ~old[:, None]
    return WindowMasks(window=window, **fields)  # type: ignore[arg-type]
