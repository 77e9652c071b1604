"""The decoder's row ops, native or torch: the one thing the layer loop varies on (issue 18
item 6; T3, T4).

:class:`RowOps` is a frozen set of five calls — an RMSNorm, a residual add fused with the norm
after it, the gate's activation times up, and attention (the per-head q/k norms, RoPE, the
K/V cache write at the step's slots and each row's attention over its own keys) — plus how a
layer's norm is handed to them. There are two values: :data:`NATIVE_ROWS` (``coda._native``'s
row kernels, ``kernels/csrc/rows.h``: float32, CPU, one fixed reduction order per row) and
:data:`TORCH_ROWS` (the same maths in torch, any dtype: ``attention.py``'s batch-invariant
attention, HF's RMSNorm numerics). Both are batch-invariant but round differently, so a runner
keeps one for its life. :class:`~coda.models.llama.CausalLM` takes its row ops at construction
(from :class:`~coda.models.backend.Backend`, chosen once at load by mode resolution) and runs one
layer loop over :class:`LayerCalls` plans: nothing is chosen or imported per layer or per step.

This module never imports ``coda.engine``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from coda.models.attention import (
    AttentionMetadata,
    attend_native,
    native_attention_refusal,
    paged_attention,
)
from coda.models.attention_window import WindowMasks, window_masks
from coda.models.config import ModelConfig
from coda.models.kernels import ops as native_ops
from coda.models.kernels import unavailable
from coda.models.rope import apply_rope

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerCalls:
    """One decoder layer as the loop runs it: its projections as plain calls and its norms as
    the row ops take them (:attr:`RowOps.norm_ref`); the Qwen3 / Gemma 3 extras are None
    where absent."""

    norm_in: Any
    qkv: Linear
    o: Linear
    norm_mid: Any  # NOTE: the MLP's input norm (Gemma 3: pre_feedforward_layernorm)
    gate_up: Linear
    down: Linear
    norm_out: Any  # NOTE: the next layer's input norm, or the final norm
    q_norm: Any = None  # per-head q/k norms before RoPE (Qwen3, Gemma 3)
    k_norm: Any = None
    post_attn: Any = None  # sandwich norms (Gemma 3)
    post_ff: Any = None
    local: bool = False  # a sliding-window layer (Gemma 3)
    scale: float | None = None  # the query scale (None: 1/sqrt(d))


@dataclass(frozen=True)
class StepRope:
    """One step's rotary tables ``[T, 1, rot]`` (cos, signed sin; see ``rope.apply_rope``) for
    one kind of layer, its sliding window (0: none) and, for the torch rows, the window's
    masks (computed once per step, shared by every local layer)."""

    cos: torch.Tensor
    sin: torch.Tensor
    window: int = 0
    masks: WindowMasks | None = None


@dataclass(frozen=True)
class RowOps:
    """The row ops one layer loop runs over (module docstring). ``norm_ref`` turns a layer's
    ``RMSNorm`` module into what ``norm``/``add_norm`` take; ``add_norm(h, r, n, eps)``
    returns ``(h + r, norm(h + r))`` (the native op updates ``h`` in place)."""

    name: str
    plan_once: bool  # NOTE: keep the layer plan from the first step (else rebuilt each step)
    norm_ref: Callable[[Any], Any]
    norm: Callable[[torch.Tensor, Any, float], torch.Tensor]
    add_norm: Callable[[torch.Tensor, torch.Tensor, Any, float],
                       tuple[torch.Tensor, torch.Tensor]]
    act: Callable[[torch.Tensor, bool], torch.Tensor]  # (gate | up, gelu_tanh?) -> gated
    attend: Callable[[torch.Tensor, StepRope, torch.Tensor, AttentionMetadata, LayerCalls,
                      ModelConfig], torch.Tensor]
    window: Callable[[AttentionMetadata, int], WindowMasks | None]  # a step's local masks


def native_norm_weight(norm: Any) -> torch.Tensor | None:
    """The float32 weight the native norm multiplies by: ``offset + w`` (Gemma's HF ``1 + w``,
    as HF rounds it: in float32), or ``w``; None for no norm."""
    if norm is None:
        return None
    w: torch.Tensor = norm.weight.detach()
    return (norm.offset + w.float()).contiguous() if norm.offset else w


def _native_add_norm(h: torch.Tensor, r: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return h, native_ops.add_rms_norm(h, r, w, eps)  # NOTE: h += r in place


def _native_act(gu: torch.Tensor, gelu: bool) -> torch.Tensor:
    return native_ops.gelu_tanh_mul(gu) if gelu else native_ops.silu_mul(gu)


def _native_attend(qkv: torch.Tensor, rope: StepRope, kv_layer: torch.Tensor,
                   meta: AttentionMetadata, p: LayerCalls, cfg: ModelConfig) -> torch.Tensor:
    return attend_native(qkv, rope.cos, rope.sin, kv_layer, meta, cfg.num_heads,
                         cfg.num_kv_heads, window=rope.window, scale=p.scale,
                         q_norm=p.q_norm, k_norm=p.k_norm, eps=cfg.rms_norm_eps)


def _no_masks(meta: AttentionMetadata, window: int) -> None:
    return None  # NOTE: the native kernel masks the window itself


NATIVE_ROWS = RowOps("native", True, native_norm_weight, native_ops.rms_norm, _native_add_norm,
                     _native_act, _native_attend, _no_masks)


def _torch_norm(x: torch.Tensor, norm: Any, eps: float) -> torch.Tensor:
    out: torch.Tensor = norm(x)  # NOTE: the module keeps its eps and its HF dtype rules
    return out


def _torch_add_norm(h: torch.Tensor, r: torch.Tensor, norm: Any,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    h = h + r
    return h, _torch_norm(h, norm, eps)


def _torch_act(gu: torch.Tensor, gelu: bool) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up


def _torch_attend(qkv: torch.Tensor, rope: StepRope, kv_layer: torch.Tensor,
                  meta: AttentionMetadata, p: LayerCalls, cfg: ModelConfig) -> torch.Tensor:
    n, d, qs, kvs = qkv.shape[0], cfg.head_dim, cfg.q_size, cfg.kv_size
    v = qkv[:, qs + kvs:].view(n, cfg.num_kv_heads, d)
    if p.q_norm is not None and p.k_norm is not None:
        q, k, _ = torch.split(qkv, [qs, kvs, kvs], dim=-1)
        # NOTE: Qwen3 and Gemma 3 normalise per head, pre-RoPE
        q = p.q_norm(q.view(n, cfg.num_heads, d))
        k = p.k_norm(k.view(n, cfg.num_kv_heads, d))
        q, k = apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin)
    else:
        # NOTE: q and k heads side by side: one RoPE pass over [T, H + H_kv, d]
        qk = qkv[:, : qs + kvs].view(n, -1, d)
        q, k = torch.split(apply_rope(qk, rope.cos, rope.sin),
                           [cfg.num_heads, cfg.num_kv_heads], dim=1)
    return paged_attention(q, k, v, kv_layer, meta, p.scale, rope.masks)


# NOTE: the torch rows read the modules at every step, as module calls did (a module or flag
# changed after the first step is seen); the native plan is kept (~10% of a batch-1 step)
TORCH_ROWS = RowOps("torch", False, lambda norm: norm, _torch_norm, _torch_add_norm, _torch_act,
                    _torch_attend, window_masks)


def default_rows() -> RowOps:
    """The row ops of a model built without a backend (tests, scripts): native where the
    module runs here; a runner that refuses native attention for the model's shape or dtype
    still runs the torch rows (see :meth:`CausalLM.row_ops`)."""
    return NATIVE_ROWS if unavailable() is None else TORCH_ROWS


def rows_for(cfg: ModelConfig, dtype: str, device: str) -> tuple[RowOps, str]:
    """The row ops a model of ``cfg`` served in ``dtype`` on ``device`` runs, and the load
    summary's line for them: native unless :func:`native_attention_refusal` says why not."""
    why = native_attention_refusal(cfg, getattr(torch, dtype), torch.device(device))
    if why is None:
        return NATIVE_ROWS, "native row kernel"
    return TORCH_ROWS, f"torch ({why})"
