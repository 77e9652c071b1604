"""Per-step attention metadata for the paged, batch-invariant attention (SPEC T3, T4).

A step's batch is FLATTENED: the new tokens of every sequence are concatenated, grouped by
sequence, in batch order. Each sequence brings a chunk of ``q_b`` new tokens (a prefill chunk
or one decode token) on top of ``ctx_b - q_b`` tokens already in its cache::

    flat token t:    0  1  2 | 3 | 4  5        (B = 3 sequences, T = 6 tokens)
    seq of t:        0  0  0 | 1 | 2  2
    query_lens:      3         1   2
    context_lens:    3         9   6          (cache length AFTER this step)
    positions:       0  1  2 | 8 | 4  5        ctx_b - q_b + i

Logical position ``p`` of sequence ``b`` lives in physical block ``block_tables[b][p // bs]``
at offset ``p % bs``; ``slot_mapping[t]`` is that flat slot for each new token.

Keys are cut into fixed SPLITS of :func:`split_size` keys counted from position 0. The rows of
a step are grouped for ``attention.py`` as:

* :class:`DecodeRows` — every decode row (``q_b == 1``), one call, keys padded to the longest;
* :class:`PrefillRows` — the prefill chunks, cut into query blocks by split: block ``j`` holds
  each chunk's tokens whose position lies in split ``j``; they attend key splits ``0..j`` only
  (the causal triangle is never materialised above the diagonal split).

This module never imports ``coda.engine``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# NOTE: keys per split. Any fixed value keeps T4; 64 keeps the per-split matmuls reasonably
# sized while wasting at most 63 masked key slots per row.
_SPLIT_KEYS = 64


def split_size(block_size: int) -> int:
    """Keys per attention split: a whole number of blocks, at least :data:`_SPLIT_KEYS`."""
    return block_size * -(-_SPLIT_KEYS // block_size)


@dataclass(frozen=True)
class DecodeRows:
    """All decode rows of the step: ``num_seqs`` sequences × one token, against
    ``num_splits`` × ``split`` key slots gathered block by block (padded with block 0)."""

    num_seqs: int
    num_splits: int
    split: int
    tokens: torch.Tensor | None  # LongTensor[G]: flat token of each row; None = 0..G-1
    block_index: torch.Tensor  # LongTensor[G * num_splits * split / bs]
    visible: torch.Tensor  # BoolTensor[1, G, 1, S * split]: key slot <= the row's position
    hidden: torch.Tensor  # ~visible
    dead: torch.Tensor | None  # BoolTensor[1, G, S, 1, 1]: split after the row's last; None: none


@dataclass(frozen=True)
class PrefillBlock:
    """Query block ``j``: for ``len(seqs)`` chunks, their (up to ``rows``) tokens in split ``j``.

    Short blocks are padded by repeating their last token; ``real`` drops the padding rows."""

    split_index: int
    rows: int
    seqs: torch.Tensor | None  # LongTensor[G_j]: indexes into PrefillRows' sequences; None = all
    tokens: torch.Tensor  # LongTensor[G_j * rows]: flat token of each row
    diag_hidden: torch.Tensor  # BoolTensor[1, G_j, rows, 1, split]: keys of split j after the row
    real: torch.Tensor | None  # LongTensor[n]: non-padding rows of [G_j * rows]; None = all
    out_tokens: torch.Tensor  # LongTensor[n]: flat token of each real row


@dataclass(frozen=True)
class PrefillRows:
    """The step's prefill chunks: keys of splits ``0..num_splits-1`` gathered once per layer."""

    num_seqs: int
    num_splits: int
    split: int
    block_index: torch.Tensor  # LongTensor[G * num_splits * split / bs]
    blocks: tuple[PrefillBlock, ...]
    # NOTE: for the non-invariant SDPA mode only: dense rows [G, Q] and their visibility.
    dense_tokens: torch.Tensor | None = None  # LongTensor[G * Q] (padding repeats a token)
    dense_visible: torch.Tensor | None = None  # BoolTensor[G, 1, Q, S * split]
    dense_real: torch.Tensor | None = None  # LongTensor[n] real rows of [G * Q]
    dense_out: torch.Tensor | None = None  # LongTensor[n] their flat tokens


@dataclass(frozen=True)
class KernelRows:
    """For the native row-by-row kernel (``kernels/csrc/rows.h``): each flat token's
    sequence and every sequence's block table, padded with block 0 to the longest."""

    seq_of: torch.Tensor  # LongTensor[T]: index into tables of each flat token
    tables: torch.Tensor  # LongTensor[B, max_blocks]


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each new token sits, and what each query may see, for one forward step.

    ``invariant`` selects the batch-invariant algorithm (T4, the default) or plain SDPA
    (faster on long prefills, but a row's bits may depend on its batch)."""

    slot_mapping: torch.Tensor  # LongTensor[T]: flat cache slot of each new token's K/V
    positions: torch.Tensor  # LongTensor[T]: logical position of each new token
    decode: DecodeRows | None
    prefill: PrefillRows | None
    invariant: bool = True
    max_position: int = -1  # NOTE: the largest of positions (-1: unknown)
    # NOTE: set (and decode/prefill None) when the step runs the native kernel
    rows: KernelRows | None = None

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
        invariant: bool = True,
        kernel: bool = False,
    ) -> AttentionMetadata:
        """Build the step's tensors from per-sequence Python lists (``kernel``: only what the
        native row-by-row kernel reads, :class:`KernelRows`).

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
        max_position = max(context_lens) - 1
        if kernel:
            width = max(len(r) for r in block_tables)
            return cls(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                positions=torch.tensor(positions, dtype=torch.long, device=device),
                decode=None, prefill=None, invariant=True, max_position=max_position,
                rows=KernelRows(
                    seq_of=torch.tensor([b for b in range(n) for _ in range(query_lens[b])],
                                        dtype=torch.long, device=device),
                    tables=torch.tensor([list(r) + [0] * (width - len(r)) for r in block_tables],
                                        dtype=torch.long, device=device)),
            )  # fmt: skip
        split = split_size(bs)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            decode=_decode_rows(decode, starts, context_lens, block_tables, bs, split, device,
                                in_order=len(decode) == n) if decode else None,
            prefill=_prefill_rows(prefill, starts, query_lens, context_lens, block_tables, bs,
                                  split, device, dense=not invariant) if prefill else None,
            invariant=invariant,
            max_position=max_position,
        )  # fmt: skip


def _extend_slots(slots: list[int], row: Sequence[int], start: int, end: int, bs: int) -> None:
    """Append the flat slots of positions ``[start, end)``, one ``range`` per block."""
    for j in range(start // bs, (end - 1) // bs + 1):
        lo, hi = max(start, j * bs), min(end, (j + 1) * bs)
        base = row[j] * bs - j * bs
        slots.extend(range(base + lo, base + hi))


def _block_index(rows: list[int], tables: Sequence[Sequence[int]], n_blocks: int,
                 device: torch.device | str) -> torch.Tensor:
    """Each sequence's first ``n_blocks`` blocks, padded with block 0 (masked out later)."""
    flat: list[int] = []
    for b in rows:
        used = tables[b][:n_blocks]
        flat.extend(used)
        flat.extend([0] * (n_blocks - len(used)))
    return torch.tensor(flat, dtype=torch.long, device=device)


def _decode_rows(rows: list[int], starts: list[int], context_lens: Sequence[int],
                 tables: Sequence[Sequence[int]], bs: int, split: int,
                 device: torch.device | str, in_order: bool) -> DecodeRows:
    # NOTE: built from Python ints with few tensor ops: this runs every decode step.
    ctx_list = [context_lens[b] for b in rows]
    n_splits = -(-max(ctx_list) // split)
    g, key_len = len(rows), n_splits * split
    ctx = torch.tensor(ctx_list)
    visible = (torch.arange(key_len)[None, :] < ctx[:, None]).view(1, g, 1, key_len)
    lasts = [(c - 1) // split for c in ctx_list]
    dead = None
    if min(lasts) < n_splits - 1:
        dead = (torch.arange(n_splits)[None, :] > torch.tensor(lasts)[:, None]).view(
            1, g, n_splits, 1, 1).to(device)
    return DecodeRows(
        num_seqs=g, num_splits=n_splits, split=split,
        tokens=None if in_order else torch.tensor([starts[b] for b in rows], device=device),
        block_index=_block_index(rows, tables, key_len // bs, device),
        visible=visible.to(device), hidden=(~visible).to(device), dead=dead,
    )  # fmt: skip


def _prefill_rows(rows: list[int], starts: list[int], query_lens: Sequence[int],
                  context_lens: Sequence[int], tables: Sequence[Sequence[int]], bs: int,
                  split: int, device: torch.device | str, dense: bool) -> PrefillRows:
    """Cut each chunk into query blocks by split (see the module docstring)."""
    first = [(context_lens[b] - query_lens[b]) // split for b in rows]
    last = [(context_lens[b] - 1) // split for b in rows]
    n_splits = max(last) + 1
    blocks: list[PrefillBlock] = []
    for j in range(min(first), n_splits):
        members = [i for i in range(len(rows)) if first[i] <= j <= last[i]]
        if not members:
            continue
        spans = []  # NOTE: per member: first position in split j, and how many tokens
        for i in members:
            b = rows[i]
            lo = max(context_lens[b] - query_lens[b], j * split)
            spans.append((i, lo, min(context_lens[b], (j + 1) * split) - lo))
        blocks.append(_prefill_block(j, spans, rows, starts, context_lens, query_lens, split,
                                     len(rows), device))
    fields: dict[str, torch.Tensor] = {}
    if dense:
        fields = _dense(rows, starts, query_lens, context_lens, n_splits * split, device)
    return PrefillRows(
        num_seqs=len(rows), num_splits=n_splits, split=split,
        block_index=_block_index(rows, tables, n_splits * split // bs, device),
        blocks=tuple(blocks), **fields,
    )  # fmt: skip


def _prefill_block(j: int, spans: list[tuple[int, int, int]], rows: list[int],
                   starts: list[int], context_lens: Sequence[int], query_lens: Sequence[int],
                   split: int, n_seqs: int, device: torch.device | str) -> PrefillBlock:
    r = max(count for _, _, count in spans)
    tokens: list[int] = []
    real: list[int] = []
    out: list[int] = []
    pos: list[int] = []
    for k, (i, lo, count) in enumerate(spans):
        b = rows[i]
        first_tok = starts[b] + lo - (context_lens[b] - query_lens[b])
        for x in range(r):
            y = min(x, count - 1)  # NOTE: padding repeats the block's last real token
            tokens.append(first_tok + y)
            pos.append(lo + y)
            if x < count:
                real.append(k * r + x)
                out.append(first_tok + x)
    g = len(spans)
    key_pos = torch.arange(j * split, (j + 1) * split)
    diag = (key_pos[None, :] > torch.tensor(pos)[:, None]).view(1, g, r, 1, split)
    padded = len(real) != len(tokens)
    return PrefillBlock(
        split_index=j, rows=r,
        seqs=None if g == n_seqs else torch.tensor([i for i, _, _ in spans], device=device),
        tokens=torch.tensor(tokens, device=device), diag_hidden=diag.to(device),
        real=torch.tensor(real, device=device) if padded else None,
        out_tokens=torch.tensor(out, device=device),
    )  # fmt: skip


def _dense(rows: list[int], starts: list[int], query_lens: Sequence[int],
           context_lens: Sequence[int], key_len: int,
           device: torch.device | str) -> dict[str, torch.Tensor]:
    """Dense ``[G, Q]`` rows for the SDPA mode (padding repeats each chunk's last token)."""
    q = torch.tensor([query_lens[b] for b in rows])
    ctx = torch.tensor([context_lens[b] for b in rows])
    offset = torch.minimum(torch.arange(int(q.max()))[None, :], q[:, None] - 1)  # [G, Q]
    pos = (ctx - q)[:, None] + offset
    flat = (torch.tensor([starts[b] for b in rows])[:, None] + offset).flatten()
    real = (torch.arange(int(q.max()))[None, :] < q[:, None]).flatten().nonzero().flatten()
    visible = (torch.arange(key_len)[None, None, :] <= pos[:, :, None])[:, None]
    return {"dense_tokens": flat.to(device), "dense_visible": visible.to(device),
            "dense_real": real.to(device), "dense_out": flat[real].to(device)}
