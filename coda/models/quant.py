"""GGUF block quantisation kept packed for torch's CPU weight-only kernels (issue 10).

Block layouts (32 weights per block, along the input dimension, ``ggml`` order):

* ``Q4_0``: ``d:f16, qs[16]`` — weight ``j`` is ``d * (q_j - 8)``;
* ``Q4_1``: ``d:f16, m:f16, qs[16]`` — weight ``j`` is ``d * q_j + m``;
* ``Q8_0``: ``d:f16, qs:int8[32]`` — weight ``j`` is ``d * q_j``;

where ``q_j`` is the low nibble of ``qs[j]`` for ``j < 16`` and the high nibble of ``qs[j-16]``.

torch's int4 kernel (``_weight_int4pack_mm_for_cpu``, group 32) computes
``w = (q - 8) * scale + zero`` per group, so Q4_1 maps exactly with ``scale = d`` and
``zero = m + 8d``, and Q4_0 with ``zero = 0``. Numerics of :class:`Int4Linear` (the fast mode):
scales and zeros are held in bfloat16 (the file's float16 values rounded: up to ~0.4% per
group), activations are cast to bfloat16 at the kernel boundary and the output comes back in
bfloat16 precision. The kernel gives the same output row for a given input row whatever the
number of rows (T4: one kernel per weight in prefill and decode alike).

Q8_0 has one scale per 32 weights, which ``_weight_int8pack_mm`` (one scale per output
channel) cannot express. :class:`Q8Split` keeps the file's 8-bit values exactly as two int4
halves, ``q = 16 * hi + lo`` (``hi`` in -8..7, ``lo`` in 0..15), each run by the int4 kernel
(``scale = 16d, zero = 0`` and ``scale = d, zero = 8d``); :class:`Int8Linear` is the lossy
per-channel requantisation, an opt-in.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

GROUP = 32
_INNER_K_TILES = 2


def _halves(raw: np.ndarray, rows: int, offset: int, width: int) -> np.ndarray:
    """Float16 field at ``offset`` of every ``width``-byte block -> float32 [N, blocks]."""
    blocks = raw.reshape(rows, -1, width)
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``qs`` [N, blocks, 16] uint8 -> codes [N, blocks * 32] int32 in ggml order."""
    n = qs.shape[0]
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(n, -1).astype(np.int32)


def q4_groups(raw: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0/Q4_1 bytes [N, bytes] -> (codes int32 [N, K] in 0..15, scale, zero [N, K/32])
    with ``w = (code - 8) * scale + zero`` exactly (in float32)."""
    rows = raw.shape[0]
    if kind == "Q4_1":
        d, m = _halves(raw, rows, 0, 20), _halves(raw, rows, 2, 20)
        qs = raw.reshape(rows, -1, 20)[..., 4:]
        return _nibbles(qs), d, m + 8 * d
    if kind == "Q4_0":
        d = _halves(raw, rows, 0, 18)
        return _nibbles(raw.reshape(rows, -1, 18)[..., 2:]), d, np.zeros_like(d)
    raise ValueError(f"not a 4-bit block type: {kind}")


def q8_0_groups(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw Q8_0 bytes [N, bytes] -> (values int32 [N, K] in -128..127, scale [N, K/32])."""
    rows = raw.shape[0]
    d = _halves(raw, rows, 0, 34)
    q = raw.reshape(rows, -1, 34)[..., 2:].copy().view(np.int8).reshape(rows, -1)
    return q.astype(np.int32), d


def dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, center: int) -> torch.Tensor:
    """Float32 weights ``(code - center) * scale + zero`` per group of 32 (the exact mode)."""
    n, k = codes.shape
    c = torch.from_numpy(codes).float().view(n, k // GROUP, GROUP) - center
    w = c * torch.from_numpy(scale)[..., None] + torch.from_numpy(zero)[..., None]
    return w.view(n, k)


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros)
    return out


class Int4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with W held as int4 codes + bfloat16 group scale/zero."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(self, codes: np.ndarray, scale: np.ndarray, zero: np.ndarray,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        n, k = codes.shape
        if k % GROUP or n % 16:
            raise ValueError(f"int4 kernel needs K % {GROUP} == 0 and N % 16 == 0, got {n}x{k}")
        self.in_features, self.out_features = k, n
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            torch.from_numpy(np.ascontiguousarray(codes)), _INNER_K_TILES)
        sz = torch.stack([torch.from_numpy(scale), torch.from_numpy(zero)], dim=-1)
        self.register_buffer("packed", packed)
        # NOTE: the kernel wants [K / group, N, 2] in the activation dtype (bfloat16).
        self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous().to(torch.bfloat16))
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = _int4_mm(flat, self.packed, self.scales_zeros).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Q8Split(nn.Module):
    """A Q8_0 matrix run exactly (up to bfloat16 scales) as two int4 matmuls, summed in float32."""

    def __init__(self, values: np.ndarray, scale: np.ndarray) -> None:
        super().__init__()
        lo = values & 0xF  # NOTE: two's complement: values = 16 * (values >> 4) + (values & 15)
        hi = (values >> 4) + 8
        zeros = np.zeros_like(scale)
        self.hi = Int4Linear(hi, 16 * scale, zeros)
        self.lo = Int4Linear(lo, scale, 8 * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.hi(x).float() + self.lo(x).float()
        return out


class Int8Linear(nn.Module):
    """Per-output-channel int8 requantisation of a dense weight (lossy; an opt-in)."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        self.register_buffer("qweight", torch.round(w / scale[:, None]).to(torch.int8))
        self.register_buffer("scale", scale.to(torch.bfloat16))
        self.in_features, self.out_features = w.shape[1], w.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(flat, self.qweight, self.scale)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
