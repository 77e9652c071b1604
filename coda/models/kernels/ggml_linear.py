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

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from coda.models.kernels import native

TILE, QK = 8, 32
# kind -> (bytes per block, bytes of quants per block); the order is the kernel's kind number
KINDS = {"Q4_0": (18, 16), "Q4_1": (20, 16), "Q8_0": (34, 32)}
ACTS = ("f32", "q8")


def repack(raw: np.ndarray, kind: str, out_features: int,
           in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw GGUF row bytes [N, row bytes] -> (float16 scales [T, B, 8 or 16], quants uint8
    [T, B, 8, 16|32]) with T = ceil(N / 8) tiles (padding rows are zero) and B = K / 32 blocks:
    per tile-block the 8 rows' d, then (Q4_1) their m; Q8_0 quants of rows 2p and 2p + 1 are
    interleaved by halves (the kernel's pair layout). As many bytes as the file's blocks."""
    if kind not in KINDS:
        raise ValueError(f"unsupported block kind {kind!r}; use one of {sorted(KINDS)}")
    if in_features <= 0 or in_features % QK or out_features <= 0:
        raise ValueError(f"shape {out_features}x{in_features}: K must be a positive multiple "
                         f"of {QK}")
    size, qb = KINDS[kind]
    nb = in_features // QK
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.size != out_features * nb * size:
        raise ValueError(f"{raw.size} bytes do not hold a {kind} {out_features}x{in_features} "
                         f"matrix ({out_features * nb * size} expected)")
    tiles = -(-out_features // TILE)
    blocks = np.zeros((tiles * TILE, nb, size), np.uint8)
    blocks[:out_features] = raw.reshape(out_features, nb, size)
    fields = size - qb  # NOTE: d (and Q4_1's m): float16 fields ahead of the quants
    sc = blocks[..., :fields].copy().view(np.float16)  # [N, B, 1 or 2]
    sc = np.ascontiguousarray(sc.reshape(tiles, TILE, nb, -1).transpose(0, 2, 3, 1))
    q = blocks[..., fields:].reshape(tiles, TILE, nb, qb).transpose(0, 2, 1, 3)  # [T, B, 8, qb]
    if kind == "Q8_0":  # NOTE: pairs of rows as [c 0..15 | c+1 0..15 | c 16..31 | c+1 16..31]
        q = q.reshape(tiles, nb, TILE // 2, 2, 2, 16).transpose(0, 1, 2, 4, 3, 5)
    q = np.ascontiguousarray(q).reshape(tiles, nb, TILE, qb)
    return torch.from_numpy(sc.reshape(tiles, nb, -1)), torch.from_numpy(q)


class GgmlLinear(nn.Module):
    """``y = x @ W.T`` with W the GGUF matrix ``raw`` ([N, row bytes] as ``GGUFReader`` gives)."""

    scales: torch.Tensor  # NOTE: buffers (repack's layout), typed for the pointer calls
    quants: torch.Tensor

    def __init__(self, raw: np.ndarray, kind: str, out_features: int, in_features: int,
                 act: str = "f32") -> None:
        super().__init__()
        if act not in ACTS:
            raise ValueError(f"unknown activation mode {act!r}; use one of {ACTS}")
        # NOTE: KernelUnavailable here if the module is missing
        self._linear: Callable[..., None] = native().linear
        sc, qs = repack(raw, kind, out_features, in_features)
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
