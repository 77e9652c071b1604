"""The decoder's native row ops on torch tensors (issues 10, 18; T3, T4): each wrapper checks
dtype, device and layout, allocates the output and hands ``coda._native`` data pointers and
shapes (``csrc/rows.h`` says what each computes and in which order). Shape errors are
``ValueError``; an index that would address memory outside the cache is ``IndexError`` (raised
by the module's checks before any kernel runs)."""

from __future__ import annotations

import torch

from coda.models.kernels import native


def _check(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or not t.is_contiguous() or not t.is_cpu:
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor")


def _rows(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    _check(x, torch.float32, "x")
    _check(w, torch.float32, "weight")
    if x.dim() != 2 or w.dim() != 1 or w.shape[0] != x.shape[1]:
        raise ValueError("x must be [T, D] and weight [D]")
    return x.shape[0], x.shape[1]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Row-wise RMSNorm of float32 ``x`` [T, D] with weight ``w`` [D]."""
    t, d = _rows(x, w)
    y = torch.empty_like(x)
    native().rms_norm(x.data_ptr(), w.data_ptr(), eps, y.data_ptr(), t, d)
    return y


def add_rms_norm(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``x += r`` in place, returns ``rms_norm(x)``: the residual add and the next norm."""
    t, d = _rows(x, w)
    _check(r, torch.float32, "residual")
    if r.shape != x.shape:
        raise ValueError("residual must match x")
    y = torch.empty_like(x)
    native().add_rms_norm(x.data_ptr(), r.data_ptr(), w.data_ptr(), eps, y.data_ptr(), t, d)
    return y


def _gate(gu: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    _check(gu, torch.float32, "gate_up")
    if gu.dim() != 2 or gu.shape[1] % 16:
        raise ValueError("gate_up must be [T, 2I] with I a multiple of 8")
    t, i = gu.shape[0], gu.shape[1] // 2
    return t, i, torch.empty((t, i), dtype=torch.float32)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate | up) -> ``silu(gate) * up`` [T, I]; I a multiple of 8."""
    t, i, y = _gate(gu)
    native().silu_mul(gu.data_ptr(), y.data_ptr(), t, i)
    return y


def gelu_tanh_mul(gu: torch.Tensor) -> torch.Tensor:
    """``[T, 2I]`` (gate | up) -> ``gelu_tanh(gate) * up`` [T, I] (Gemma 3's gate; torch's
    ``F.gelu(approximate="tanh")`` to rounding); I a multiple of 8."""
    t, i, y = _gate(gu)
    native().gelu_tanh_mul(gu.data_ptr(), y.data_ptr(), t, i)
    return y


def attend(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_layer: torch.Tensor,
           slots: torch.Tensor, seq_of: torch.Tensor, positions: torch.Tensor,
           tables: torch.Tensor, n_heads: int, n_kv: int, *, window: int = 0,
           scale: float | None = None, q_norm: torch.Tensor | None = None,
           k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """``qkv`` [T, (H + 2 H_kv) d] -> [T, H d]: RoPE, the K/V write at ``slots`` into
    ``kv_layer`` [2, H_kv, blocks, bs, d], each row's attention over its own keys (block table
    ``tables[seq_of[t]]``, positions ``0..positions[t]``; with ``window`` > 0 only the last
    ``window`` of them, its own included: a sliding-window layer). ``cos``/``sin`` are
    [T, rot] with ``rot`` <= d the rotated dims (fewer than d: partial rotary; the rest pass
    through). ``scale``: the query scale (None: 1/sqrt(d)); ``q_norm``/``k_norm``: per-head
    RMSNorm weights [d] applied to q and k before RoPE (Qwen3, Gemma 3), epsilon ``eps``."""
    _check(kv_layer, torch.float32, "kv_layer")
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2 or kv_layer.shape[1] != n_kv:
        raise ValueError("kv_layer must be [2, H_kv, blocks, bs, d]")
    d, t = kv_layer.shape[4], qkv.shape[0]
    _check(qkv, torch.float32, "qkv")
    if qkv.dim() != 2 or qkv.shape[1] != (n_heads + 2 * n_kv) * d:
        raise ValueError("qkv must be [T, (H + 2 H_kv) d]")
    rot = cos.numel() // t if t else d
    for name, tab in (("cos", cos), ("sin", sin)):
        _check(tab, torch.float32, name)
        if tab.numel() != t * rot or rot > d or rot % 2 or rot == 0:
            raise ValueError(f"{name} must be [T, rot] with rot even and <= d")
    norms = []
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            _check(w, torch.float32, name)
            if w.numel() != d:
                raise ValueError(f"{name} must be [d]")
        norms.append(0 if w is None else w.data_ptr())
    if window < 0 or (scale is not None and not scale > 0):
        raise ValueError("window must be >= 0 and scale > 0")
    for name, idx in (("slots", slots), ("seq_of", seq_of), ("positions", positions)):
        _check(idx, torch.int64, name)
        if idx.numel() != t:
            raise ValueError(f"{name} must be [T]")
    _check(tables, torch.int64, "tables")
    if tables.dim() != 2:
        raise ValueError("tables must be [B, max_blocks]")
    out = torch.empty((t, n_heads * d), dtype=torch.float32)
    native().attend(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), kv_layer.data_ptr(),
                    slots.data_ptr(), seq_of.data_ptr(), positions.data_ptr(), tables.data_ptr(),
                    t, n_heads, n_kv, d, kv_layer.shape[2], kv_layer.shape[3], tables.shape[0],
                    tables.shape[1], out.data_ptr(), rot, window, scale or 0.0, norms[0],
                    norms[1], eps)
    return out
