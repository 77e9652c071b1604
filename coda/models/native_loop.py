"""The decoder's layer loop as bare native calls (issue 18 item 3; issue 21's verification
steps pay the same per-step cost; T3, T4).

At batch 1 on SmolLM2-135M (30 layers, hidden 576) a step spent milliseconds outside the
kernels: every projection's ``direct()`` call checked its input, allocated its output and read
its weights' pointers; every row op (``kernels/ops.py``) re-checked the step's tensors; 8 such
wrappers per layer. :class:`NativeLoop` runs the same native calls, in the same order, on the
same values: the weights' and norms' pointers resolved once per plan
(:class:`~coda.models.kernels.raw.RawLinear`), the step's tensors checked and its buffers
allocated once per step, then per layer only the kernel calls. The bits are the per-op loop's
(``CausalLM.forward``), which tests/test_native_loop.py checks.

It runs where every projection of the plan carries a :class:`RawLinear` (the packed GGUF
kernels, the fp32-kernel mode) and the row ops are the native ones; anything else (``F.linear``
projections, the torch rows, a non-float32 stream) runs the per-op loop. This module never
imports ``coda.engine``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from coda.models.attention_meta import AttentionMetadata
from coda.models.config import ModelConfig
from coda.models.kernels import native
from coda.models.kernels.raw import RawLinear, raw_of
from coda.models.row_ops import LayerCalls, StepRope


def _ptr(w: torch.Tensor | None) -> int:
    return 0 if w is None else w.data_ptr()


@dataclass(frozen=True)
class _Layer:
    """One layer's calls: projections as RawLinear, norms as weight pointers (0: none)."""

    qkv: RawLinear
    o: RawLinear
    gate_up: RawLinear
    down: RawLinear
    norm_mid: int
    norm_out: int
    q_norm: int
    k_norm: int
    post_attn: int
    post_ff: int
    local: bool
    scale: float  # NOTE: 0.0 = 1/sqrt(d), as ops.attend passes None


def _weight(w: Any, n: int) -> bool:
    """``w`` is None or what the native ops take as a norm weight: float32 contiguous [n]."""
    return w is None or (isinstance(w, torch.Tensor) and w.dtype == torch.float32
                         and w.is_contiguous() and w.is_cpu and w.numel() == n)


def _float_rows(t: torch.Tensor, rows: int, cols: int, name: str) -> None:
    if t.dtype != torch.float32 or not t.is_contiguous() or not t.is_cpu \
            or t.numel() != rows * cols:
        raise ValueError(f"{name} must be a contiguous float32 CPU tensor of {rows}x{cols}")


def _index(t: torch.Tensor, n: int, name: str) -> None:
    if t.dtype != torch.int64 or not t.is_contiguous() or not t.is_cpu or t.numel() != n:
        raise ValueError(f"{name} must be a contiguous int64 CPU tensor of {n}")


class NativeLoop:
    """A plan's layers as bare native calls (module docstring); :meth:`build` says whether a
    plan can run so. The native functions are attributes, so a profiler may wrap them."""

    def __init__(self, layers: Sequence[_Layer], norm_in: torch.Tensor,
                 cfg: ModelConfig, keep: Sequence[Any]) -> None:
        mod = native()
        self.layers = tuple(layers)
        self.norm_in = norm_in
        self.keep = tuple(keep)  # NOTE: the norm weights the pointers address
        self.cfg = cfg
        self.attend: Callable[..., None] = mod.attend
        self.rms_norm: Callable[..., None] = mod.rms_norm
        self.add_rms_norm: Callable[..., None] = mod.add_rms_norm
        self.act: Callable[..., None] = (mod.gelu_tanh_mul if cfg.hidden_act == "gelu_tanh"
                                         else mod.silu_mul)
        first = self.layers[0]
        self.width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.inter = first.gate_up.out_features // 2
        self.sandwich = any(ly.post_attn or ly.post_ff for ly in self.layers)

    @classmethod
    def build(cls, plan: Sequence[LayerCalls], cfg: ModelConfig) -> NativeLoop | None:
        """The loop of ``plan`` (native row ops' norm refs: float32 weights or None), or None
        where a projection has no :class:`RawLinear`, a shape differs from ``cfg``'s or the
        gate's width is not the native op's (a multiple of 8)."""
        if not plan or plan[0].norm_in is None or not _weight(plan[0].norm_in, cfg.hidden_size):
            return None
        d, width = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        layers: list[_Layer] = []
        keep: list[Any] = [plan[0].norm_in]
        for p in plan:
            raws = [raw_of(f) for f in (p.qkv, p.o, p.gate_up, p.down)]
            qkv, o, gu, dn = raws
            if qkv is None or o is None or gu is None or dn is None:
                return None
            inter = gu.out_features // 2
            if (qkv.in_features, qkv.out_features, o.in_features, o.out_features) != \
                    (d, width, cfg.q_size, d) or gu.in_features != d or gu.out_features % 16 \
                    or (dn.in_features, dn.out_features) != (inter, d) \
                    or p.norm_mid is None or p.norm_out is None:
                return None
            norms = (p.norm_mid, p.norm_out, p.q_norm, p.k_norm, p.post_attn, p.post_ff)
            sizes = (d, d, cfg.head_dim, cfg.head_dim, d, d)
            if not all(_weight(w, n) for w, n in zip(norms, sizes, strict=True)):
                return None
            keep.extend(norms)
            mid, out, qn, kn, pa, pf = (_ptr(w) for w in norms)
            layers.append(_Layer(qkv, o, gu, dn, mid, out, qn, kn, pa, pf, p.local,
                                 p.scale or 0.0))
        if len({ly.gate_up.out_features for ly in layers}) != 1:
            return None  # NOTE: one gate buffer per step serves every layer
        return cls(layers, plan[0].norm_in, cfg, keep)

    def run(self, h: torch.Tensor, full: StepRope, local: StepRope,
            kv_layers: Sequence[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """The residual stream ``h`` [T, D] (float32, updated in place) through every layer;
        returns the final norm's output [T, D], as ``CausalLM.forward``'s per-op loop. The
        step's tensors are checked here, once (``ops.attend``'s checks); the kernel still
        checks every cache index it reads."""
        cfg, rows = self.cfg, meta.rows
        t, dim = h.shape[0], cfg.hidden_size
        n_h, n_kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if rows is None or len(kv_layers) < len(self.layers):
            raise ValueError("the native loop needs the kernel's row index and a cache layer "
                             "per layer")
        _float_rows(h, t, dim, "hidden")
        for name, tab in (("cos", full.cos), ("sin", full.sin), ("cos", local.cos),
                          ("sin", local.sin)):
            _float_rows(tab, t, hd, name)  # NOTE: the refusal rules out partial rotary
        for name, idx in (("slots", meta.slot_mapping), ("seq_of", rows.seq_of),
                          ("positions", meta.positions)):
            _index(idx, t, name)
        tables = rows.tables
        if tables.dim() != 2:
            raise ValueError("tables must be [B, max_blocks]")
        _index(tables, tables.numel(), "tables")
        shape = kv_layers[0].shape
        if len(shape) != 5 or shape[0] != 2 or shape[1] != n_kv or shape[4] != hd:
            raise ValueError("kv_layer must be [2, H_kv, blocks, bs, d]")
        kv_ptrs = []
        for kv in kv_layers[: len(self.layers)]:
            if kv.shape != shape or kv.dtype != torch.float32 or not kv.is_contiguous() \
                    or not kv.is_cpu:
                raise ValueError("every kv_layer must be a contiguous float32 CPU tensor of "
                                 "one shape")
            kv_ptrs.append(kv.data_ptr())
        # NOTE: one buffer per role for the whole step; each is read before it is rewritten
        # (o's and down's outputs share ``r``: o's is consumed by the add before down runs)
        new = torch.empty
        qkv, att = new((t, self.width)), new((t, n_h * hd))
        r, x = new((t, dim)), new((t, dim))
        gu, act = new((t, 2 * self.inter)), new((t, self.inter))
        tmp = new((t, dim)) if self.sandwich else r
        hp, qkvp, attp, rp, xp = h.data_ptr(), qkv.data_ptr(), att.data_ptr(), r.data_ptr(), \
            x.data_ptr()
        gup, actp, tmpp = gu.data_ptr(), act.data_ptr(), tmp.data_ptr()
        tail = (meta.slot_mapping.data_ptr(), rows.seq_of.data_ptr(), meta.positions.data_ptr(),
                tables.data_ptr(), t, n_h, n_kv, hd, shape[2], shape[3], tables.shape[0],
                tables.shape[1], attp, hd)
        ropes = {False: (full.cos.data_ptr(), full.sin.data_ptr(), full.window),
                 True: (local.cos.data_ptr(), local.sin.data_ptr(), local.window)}
        eps, inter = cfg.rms_norm_eps, self.inter
        attend, add_norm, norm, gate = self.attend, self.add_rms_norm, self.rms_norm, self.act
        norm(hp, self.norm_in.data_ptr(), eps, xp, t, dim)
        for ly, kvp in zip(self.layers, kv_ptrs, strict=False):
            lin = ly.qkv
            lin.fn(xp, t, *lin.args, qkvp)
            cos, sin, window = ropes[ly.local]
            attend(qkvp, cos, sin, kvp, *tail, window, ly.scale, ly.q_norm, ly.k_norm, eps)
            lin = ly.o
            lin.fn(attp, t, *lin.args, rp)
            if ly.post_attn:
                norm(rp, ly.post_attn, eps, tmpp, t, dim)
                add_norm(hp, tmpp, ly.norm_mid, eps, xp, t, dim)
            else:
                add_norm(hp, rp, ly.norm_mid, eps, xp, t, dim)
            lin = ly.gate_up
            lin.fn(xp, t, *lin.args, gup)
            gate(gup, actp, t, inter)
            lin = ly.down
            lin.fn(actp, t, *lin.args, rp)
            if ly.post_ff:
                norm(rp, ly.post_ff, eps, tmpp, t, dim)
                add_norm(hp, tmpp, ly.norm_out, eps, xp, t, dim)
            else:
                add_norm(hp, rp, ly.norm_out, eps, xp, t, dim)
        return x
