"""The Llama-family decoder (Llama 2/3, SmolLM, Mistral, Qwen2, Qwen3, Gemma 3, Phi-3) over a
paged KV cache.

One module covers every supported architecture; :class:`~coda.models.config.ModelConfig`
switches the differences on (q/k/v bias, per-head q/k RMSNorm, tied embeddings, RoPE scaling;
Gemma 3's sliding-window local layers with their own RoPE base, four norms per layer applied as
``offset + w``, GELU-tanh gate, scaled embeddings and query scale; Phi-3's partial rotary).
RoPE frequencies come from :mod:`coda.models.rope` (every scaling type, HF or GGUF).
Projections are fused (``qkv_proj``, ``gate_up_proj``); the loader maps HF tensor names onto
them. :meth:`CausalLM.forward` takes a flattened varlen batch (see ``attention.py``) and
returns hidden states; :meth:`CausalLM.compute_logits` turns the rows you need into logits.
Numerics follow the HF reference: RMSNorm in float32, RoPE cos/sin computed in float32 and
cast to the activation dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from coda.models.attention import AttentionMetadata, PagedKVCache
from coda.models.config import ModelConfig
from coda.models.native_loop import NativeLoop
from coda.models.rope import apply_rope, cos_sin_scale, inv_freq
from coda.models.row_ops import NATIVE_ROWS, TORCH_ROWS, LayerCalls, RowOps, StepRope, default_rows

__all__ = ["CausalLM", "RMSNorm", "apply_rope"]

# NOTE: RoPE table growth step (positions); 1024 × d_h × 2 floats is 0.5 MiB at d_h = 64.
_ROPE_CHUNK = 1024


class RMSNorm(nn.Module):
    """RMSNorm scaled by ``offset + weight``: offset 0 (Llama; a Gemma GGUF, whose file stores
    ``w + 1``) or 1 (Gemma's HF weights, which, as HF, multiply in float32 before the cast)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        weight = self.weight if not self.offset else self.offset + self.weight.float()
        if dtype == torch.float32 and weight.dtype == torch.float32:
            # NOTE: one fused kernel, the same bits as the three-step formula below (checked
            # in tests/test_models.py); a row's result never depends on other rows.
            return F.rms_norm(x, weight.shape, weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * weight).to(dtype)  # NOTE: Gemma: (x * (1 + w)) in float32, then cast
        return self.weight * h.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.attention_out_bias)
        off = cfg.norm_weight_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, off) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, off) if cfg.qk_norm else None
        self.scale = cfg.attn_scale
        self.local = layer_idx in cfg.local_layers  # NOTE: a sliding-window layer (Gemma 3)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gelu = cfg.hidden_act == "gelu_tanh"


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        d, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset
        self.input_layernorm = RMSNorm(d, eps, off)
        self.self_attn = Attention(cfg, layer_idx)
        # NOTE: with sandwich norms (Gemma 3) this one normalises the attention's output and
        # pre_feedforward_layernorm takes its Llama role (the MLP's input).
        self.post_attention_layernorm = RMSNorm(d, eps, off)
        self.pre_feedforward_layernorm = RMSNorm(d, eps, off) if cfg.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(d, eps, off) if cfg.sandwich_norms else None
        self.mlp = MLP(cfg)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # NOTE: given its (zero) weight, so no random init runs: under the loader's meta device a
        # normal_ imports torch._dynamo (2-10 s of every load); weights come from the checkpoint
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.zeros(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)


def _direct(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``module`` as a plain call: a kernel's own (``direct()``), F.linear for nn.Linear."""
    direct = getattr(module, "direct", None)
    if direct is not None:
        fn: Callable[[torch.Tensor], torch.Tensor] = direct()
        return fn
    if type(module) is nn.Linear:
        return functools.partial(F.linear, weight=module.weight, bias=module.bias)
    return module


class CausalLM(nn.Module):
    """Decoder + LM head. Parameter names mirror HF's except for the fused projections."""

    def __init__(self, cfg: ModelConfig, rows: RowOps | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head: nn.Linear | None = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # NOTE: a plain attribute, not a buffer: built on CPU even under a meta-device init.
        self._inv_freq = inv_freq(cfg)
        self._inv_freq_local = inv_freq(cfg, local=True)
        self._rope_scale = (cos_sin_scale(cfg), cos_sin_scale(cfg, local=True))
        # NOTE: cos and signed sin [positions, 1, d] per position, grown on demand (see _rope)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._rope_table_local: tuple[torch.Tensor, torch.Tensor] | None = None
        # NOTE: a packed head (coda/models/quant.py) replaces the dense one when set.
        self.logits_head: nn.Module | None = None
        self.kernels: dict[str, str] = {}  # NOTE: tensor type -> kernel (packed modes' summary)
        # NOTE: the backend's row ops, chosen once (coda.models.backend.Backend); never per step
        self.rows: RowOps = rows if rows is not None else default_rows()
        self._plans: dict[str, list[LayerCalls]] = {}  # NOTE: by row ops; see layer_plan
        # NOTE: the native plan's fused loop, keyed by the plan object (see native_loop);
        # fused_loop = False runs the per-op loop (tests compare the two, bit for bit)
        self._loop: tuple[list[LayerCalls], NativeLoop | None] | None = None
        self.fused_loop = True

    def row_ops(self, meta: AttentionMetadata) -> RowOps:
        """The row ops of this step: the model's own (:attr:`rows`, fixed at construction)
        when the runner built the native kernel's row index (``meta.rows``: it runs native
        attention for its whole life), else the torch rows (the runner refused native
        attention for this model's dtype, device or shape, or turned it off)."""
        if meta.rows is None:
            return TORCH_ROWS
        if self.rows.name != NATIVE_ROWS.name:
            raise ValueError("the step carries native row indices, but this model's backend "
                             f"runs the {self.rows.name} row ops")
        return self.rows

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: PagedKVCache,
    ) -> torch.Tensor:
        """``input_ids``/``positions``: LongTensor[T] (flattened batch) -> hidden [T, D] after
        the final norm.

        Appends each token's K/V at ``meta.slot_mapping`` in every layer (T3). One loop over
        the layers' plans (:meth:`layer_plan`) and the step's row ops (:meth:`row_ops`): each
        residual add is fused with the norm after it, the gate's activation with the up
        product, and q/k norms, RoPE, the cache write and attention (a sliding window on local
        layers) are one call. Every op is row-local with a fixed reduction order, so a row's
        bits never depend on its batch (T4). Projections are called without module dispatch:
        at batch 1 that overhead was ~10% of the step.
        """
        h = self.model.embed_tokens(input_ids)
        cfg = self.config
        if cfg.embed_scale:
            # NOTE: as HF: sqrt(hidden) as a float32 tensor, cast to the model's dtype
            h = h * torch.tensor(cfg.hidden_size**0.5).to(h.dtype)
        ops = self.row_ops(meta)
        top = meta.max_position if meta.max_position >= 0 else int(positions.max())
        full = StepRope(*self._rope(positions, h.dtype, top))
        local = full
        if cfg.local_layers and cfg.local_window is not None:
            # NOTE: once per step, shared by every local layer (Gemma 3)
            local = StepRope(*self._rope(positions, h.dtype, top, local=True),
                             window=cfg.local_window, masks=ops.window(meta, cfg.local_window))
        eps, gelu = cfg.rms_norm_eps, cfg.hidden_act == "gelu_tanh"
        plan = self.layer_plan(ops)
        h = h.contiguous()  # NOTE: the residual stream (the native add updates it in place)
        loop = self.native_loop(ops, plan) if h.dtype == torch.float32 else None
        if loop is not None:
            return loop.run(h, full, local, kv.layers, meta)  # NOTE: the same calls, bare
        x = ops.norm(h, plan[0].norm_in, eps)
        for i, p in enumerate(plan):
            attn = p.o(ops.attend(p.qkv(x), local if p.local else full, kv.layers[i], meta, p,
                                  cfg))
            if p.post_attn is not None:
                attn = ops.norm(attn, p.post_attn, eps)
            h, x = ops.add_norm(h, attn, p.norm_mid, eps)
            mlp = p.down(ops.act(p.gate_up(x), gelu))
            if p.post_ff is not None:
                mlp = ops.norm(mlp, p.post_ff, eps)
            h, x = ops.add_norm(h, mlp, p.norm_out, eps)
        return x

    def native_loop(self, ops: RowOps, plan: list[LayerCalls]) -> NativeLoop | None:
        """The fused loop of ``plan`` (:class:`~coda.models.native_loop.NativeLoop`): built
        once per plan object (a cleared or replaced plan is seen) for the native row ops;
        None (the per-op loop runs) where it cannot run or :attr:`fused_loop` is off."""
        if not self.fused_loop or ops.name != NATIVE_ROWS.name or not ops.plan_once:
            return None
        cached = self._loop
        if cached is None or cached[0] is not plan:
            cached = self._loop = (plan, NativeLoop.build(plan, self.config))
        return cached[1]

    def layer_plan(self, ops: RowOps) -> list[LayerCalls]:
        """The layers as ``ops`` runs them (:class:`~coda.models.row_ops.LayerCalls`).

        NOTE: with ``ops.plan_once`` (native) built on the first step, after loading: it holds
        the weights' tensors (in-place loads still show), not the modules, so modules swapped
        later are not seen unless ``_plans`` is cleared (``dense_invariant.make_invariant``
        does); the torch rows' plan is rebuilt each step."""
        plan = self._plans.get(ops.name) if ops.plan_once else None
        if plan is None:
            layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]

            def ref(norm: RMSNorm | None) -> Any:
                return None if norm is None else ops.norm_ref(norm)

            plan = [LayerCalls(
                norm_in=ref(layer.input_layernorm),
                qkv=_direct(layer.self_attn.qkv_proj), o=_direct(layer.self_attn.o_proj),
                norm_mid=ref(layer.pre_feedforward_layernorm or layer.post_attention_layernorm),
                gate_up=_direct(layer.mlp.gate_up_proj), down=_direct(layer.mlp.down_proj),
                norm_out=ref(layers[i + 1].input_layernorm if i + 1 < len(layers)
                             else self.model.norm),
                q_norm=ref(layer.self_attn.q_norm), k_norm=ref(layer.self_attn.k_norm),
                post_attn=(ref(layer.post_attention_layernorm)
                           if layer.pre_feedforward_layernorm is not None else None),
                post_ff=ref(layer.post_feedforward_layernorm),
                local=layer.self_attn.local, scale=layer.self_attn.scale,
            ) for i, layer in enumerate(layers)]
            if ops.plan_once:
                self._plans[ops.name] = plan
        return plan

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype, max_position: int,
              local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin ``[T, 1, d]`` of ``positions``: two gathers from a table of the
        positions so far, grown in fixed chunks of :data:`_ROPE_CHUNK` positions, each chunk
        computed by the same ops, so a position's values never depend on when it was added.
        ``local``: the local layers' table (Gemma 3's own RoPE base)."""
        table = self._rope_table_local if local else self._rope_table
        if table is not None and (table[0].dtype != dtype or table[0].device != positions.device):
            table = None
        have = 0 if table is None else table[0].shape[0]
        if max_position >= have:
            new = [self._rope_chunk(start, dtype, positions.device, local)
                   for start in range(have, max_position + 1, _ROPE_CHUNK)]
            cos = torch.cat(([table[0]] if table is not None else []) + [c for c, _ in new])
            sin = torch.cat(([table[1]] if table is not None else []) + [s for _, s in new])
            table = (cos, sin)
            if local:
                self._rope_table_local = table
            else:
                self._rope_table = table
        assert table is not None
        return table[0].index_select(0, positions), table[1].index_select(0, positions)

    def _rope_chunk(self, start: int, dtype: torch.dtype, device: torch.device,
                    local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        inv = (self._inv_freq_local if local else self._inv_freq).to(device)
        pos = torch.arange(start, start + _ROPE_CHUNK, device=device)
        freqs = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [chunk, 1, d]
        half = freqs.shape[-1]
        scale = self._rope_scale[1 if local else 0]
        # NOTE: as HF: the attention factor applied in float32, then the cast
        cos, sin = (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)
        return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # NOTE: see apply_rope

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] (model dtype) for the given hidden rows [N, D]."""
        if self.logits_head is not None:
            packed: torch.Tensor = self.logits_head(hidden)
            return packed
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)
