"""``GgmlLinear``: a linear layer on a GGUF matrix's own blocks, batch-invariant (issue 10, T4).

Block kinds (32 weights per block along the input dimension, ggml order; see
``coda/models/quant.py``): ``Q4_0`` (w = d * (q - 8)), ``Q4_1`` (w = d * q + m), ``Q8_0``
(w = d * q). The raw row bytes are re-laid-out once at load (8 output rows per tile, as many bytes
as the file) and never dequantised into memory.

Activation modes (``act``):

* ``"f32"`` — float32 activations times the file's exact weights (dequantised in registers);
  only the summation order differs from a dense float32 product.
* ``"q8"`` — each row's activations quantised per block of 32 to int8 (scale amax / 127, round
  half to even), integer block dot products; lossy like llama.cpp's own CPU path.

In both, an output row depends on its input row only: the same bits whatever the batch size,
the row's position in it, the thread count and the CPU's instruction set (the kernel's contract,
``csrc/blocks.h``; the order every ISA shares, ``csrc/isa.h``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from coda.models.kernels import native
from coda.models.kernels.raw import RawLinear, attach

TILE, QK = 8, 32
# kind -> (bytes per block, bytes of quants per block); the order is the kernel's kind number
KINDS = {"Q4_0": (18, 16), "Q4_1": (20, 16), "Q8_0": (34, 32)}
ACTS = ("f32", "q8")


def repack(raw: np.ndarray | Sequence[np.ndarray], kind: str, out_features: int,
           in_features: int, act: str = "f32") -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF row bytes [N, row bytes] (or a fused projection's parts, [n_i, row bytes] each,
    rows concatenated) -> (float16 scales [T, B, 8 or 16], quants uint8 [T, B, 8, 16|32]) with
    T = ceil(N / 8) tiles (padding rows are zero) and B = K / 32 blocks: per tile-block the 8
    rows' d, then (Q4_1) their m; Q8_0 quants of rows 2p and 2p + 1 are interleaved by halves
    (the kernel's pair layout); Q4 quants row after row for ``act`` ``"q8"``, and in the dword
    layout for ``"f32"`` (csrc/blocks.h: group g's byte 4 l + j is row 4 g + j's byte l). As many
    bytes as the file's blocks, written once: each part's whole tiles are copied straight from
    its bytes (the mapped file, no intermediate copy), then Q4's are shuffled in place."""
    if act not in ACTS:
        raise ValueError(f"unknown activation mode {act!r}; use one of {ACTS}")
    if kind not in KINDS:
        raise ValueError(f"unsupported block kind {kind!r}; use one of {sorted(KINDS)}")
    if in_features <= 0 or in_features % QK or out_features <= 0:
        raise ValueError(f"shape {out_features}x{in_features}: K must be a positive multiple "
                         f"of {QK}")
    size, qb = KINDS[kind]
    nb = in_features // QK
    parts = [np.asarray(raw, dtype=np.uint8)] if isinstance(raw, np.ndarray) else \
        [np.asarray(r, dtype=np.uint8) for r in raw]
    if sum(p.size for p in parts) != out_features * nb * size:
        raise ValueError(f"{sum(p.size for p in parts)} bytes do not hold a {kind} "
                         f"{out_features}x{in_features} matrix ({out_features * nb * size} "
                         "expected)")
    tiles = -(-out_features // TILE)
    fields = size - qb  # NOTE: d (and Q4_1's m): float16 fields ahead of the quants
    sc = np.empty((tiles, nb, fields // 2, TILE, 2), np.uint8)  # float16 bytes, rows last
    q = np.empty((tiles, nb, TILE, qb), np.uint8)
    row = 0  # NOTE: always a whole number of tiles
    for part in parts:
        blocks = part.reshape(-1, nb, size)
        whole = len(blocks) // TILE * TILE
        _tiles_into(blocks[:whole], sc, q, row // TILE, kind)
        row += whole
        if whole < len(blocks):
            break  # NOTE: a ragged part (never in real models): the rest, zero-padded, below
    if row < out_features:
        _tiles_into(_padded_rows(parts, nb * size)[row:], sc, q, row // TILE, kind)
    if act == "f32" and kind != "Q8_0":
        # NOTE: natively: a byte-granular numpy transpose ran at ~0.2 GB/s (seconds for a 1B file)
        native().q4_dwords(q.ctypes.data, tiles * nb)
    return (torch.from_numpy(sc.reshape(tiles, nb, -1).view(np.float16)),
            torch.from_numpy(q))


def _padded_rows(parts: Sequence[np.ndarray], row_bytes: int) -> np.ndarray:
    """All parts' rows [N padded to whole tiles, row bytes], the padding rows zero."""
    rows = np.concatenate([p.reshape(-1, row_bytes) for p in parts])
    out = np.zeros((-(-len(rows) // TILE) * TILE, row_bytes), np.uint8)
    out[:len(rows)] = rows
    return out


def _tiles_into(blocks: np.ndarray, sc: np.ndarray, q: np.ndarray, t0: int, kind: str) -> None:
    """Write whole tiles of ``blocks`` ([8 t, B, block bytes]) into tiles t0.. of ``sc`` and
    ``q`` (repack's layout): one strided copy each, of float16 scales and 16-byte quant runs
    (NOTE: as uint16 / ``V16`` items, not bytes: numpy's byte-wise strided copy is 10x slower)."""
    size, qb = KINDS[kind]
    fields = size - qb
    nb = sc.shape[1]
    blocks = blocks.reshape(-1, nb, size)
    t = len(blocks) // TILE
    if not t:
        return
    # scales: [8 t, B, F] -> [t, 8, B, F] -> [t, B, F, 8]
    src = blocks[..., :fields].view(np.uint16).reshape(t, TILE, nb, fields // 2)
    np.copyto(sc[t0:t0 + t].view(np.uint16)[..., 0], src.transpose(0, 2, 3, 1))
    runs = blocks[..., fields:].view("V16")  # [8 t, B, qb / 16]
    out = q[t0:t0 + t].reshape(t, nb, TILE, qb).view("V16")  # [t, B, 8, qb / 16]
    if kind == "Q8_0":  # NOTE: pairs of rows as [c 0..15 | c+1 0..15 | c 16..31 | c+1 16..31]
        # out [t, B, p, h, j] = row 8 t + 2 p + j, block B, quants 16 h ..
        np.copyto(out.reshape(t, nb, TILE // 2, 2, 2),
                  runs.reshape(t, TILE // 2, 2, nb, 2).transpose(0, 3, 1, 4, 2))
    else:
        np.copyto(out[..., 0], runs.reshape(t, TILE, nb).transpose(0, 2, 1))


class GgmlLinear(nn.Module):
    """``y = x @ W.T`` with W the GGUF matrix ``raw`` ([N, row bytes] as ``GGUFReader`` gives;
    or a fused projection's parts, rows concatenated)."""

    scales: torch.Tensor  # NOTE: buffers (repack's layout), typed for the pointer calls
    quants: torch.Tensor

    def __init__(self, raw: np.ndarray | Sequence[np.ndarray], kind: str, out_features: int,
                 in_features: int, act: str = "f32") -> None:
        super().__init__()
        if act not in ACTS:
            raise ValueError(f"unknown activation mode {act!r}; use one of {ACTS}")
        # NOTE: KernelUnavailable here if the module is missing
        self._linear: Callable[..., None] = native().linear
        sc, qs = repack(raw, kind, out_features, in_features, act)
        self.register_buffer("scales", sc)
        self.register_buffer("quants", qs)
        self.kind, self.act = kind, act
        self.in_features, self.out_features = in_features, out_features
        self._flags = (list(KINDS).index(kind), act == "q8")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {self.in_features}")
        flat = x.reshape(-1, self.in_features).float().contiguous()
        if not flat.is_cpu:
            raise ValueError("GgmlLinear runs on CPU tensors")
        y = torch.empty((flat.shape[0], self.out_features), dtype=torch.float32)
        self._linear(flat.data_ptr(), flat.shape[0], self.in_features, self.scales.data_ptr(),
                     self.quants.data_ptr(), self.out_features, *self._flags, y.data_ptr())
        return y.view(*x.shape[:-1], self.out_features)

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel call alone, for 2-D contiguous float32 CPU inputs (the native decoder
        path: no module dispatch; the checks are a few attribute reads). Holds the weight
        buffers, so in-place loads into them still show."""
        linear, sc, qs = self._linear, self.scales, self.quants
        n, k = self.out_features, self.in_features
        kind, q8 = self._flags

        def call(x: torch.Tensor) -> torch.Tensor:
            if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k \
                    or not x.is_contiguous() or not x.is_cpu:
                raise ValueError(f"x must be a contiguous float32 CPU [M, {k}] tensor")
            y = torch.empty((x.shape[0], n), dtype=torch.float32)
            linear(x.data_ptr(), x.shape[0], k, sc.data_ptr(), qs.data_ptr(), n, kind, q8,
                   y.data_ptr())
            return y

        # NOTE: the same call with the weights' pointers resolved once (the fused loop's)
        attach(call, RawLinear(linear, (k, sc.data_ptr(), qs.data_ptr(), n, kind, q8), k, n,
                               (sc, qs)))
        return call

    def extra_repr(self) -> str:
        return f"{self.in_features}->{self.out_features}, {self.kind}, act={self.act}"


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q8 mode's activation quantisation of float32 ``x`` [M, K]: (int8 q [M, K], dx and
    sx [M, K / 32]) as the kernel computes them (for tests)."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] % QK or not x.is_contiguous():
        raise ValueError("x must be a contiguous float32 [M, K] tensor, K % 32 == 0")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    dx, sx = torch.empty((m, k // QK)), torch.empty((m, k // QK))
    native().quantize_rows(x.data_ptr(), m, k, q.data_ptr(), dx.data_ptr(), sx.data_ptr())
    return q, dx, sx
