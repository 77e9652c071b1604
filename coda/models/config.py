"""Model configuration, normalised once from a Hugging Face ``config.json`` (SPEC T3).

:class:`ModelConfig` is frozen: every architecture quirk (Qwen2's q/k/v bias, Qwen3's per-head
q/k RMSNorm, SmolLM's tied embeddings, Llama 3's RoPE scaling, Mistral's sliding window) is
resolved here into plain fields, so model code never looks at the raw dict. This module does
not import torch (the engine's bookkeeping may use it without loading torch).

Supported ``architectures``: LlamaForCausalLM (also SmolLM/SmolLM2), MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM (Gemma 3 text), Phi3ForCausalLM
(Phi-3/3.5/4-mini). Supported RoPE scaling types: ``llama3``, ``linear``, ``dynamic``, ``yarn``
and ``longrope`` (Phi-3's ``su``/``yarn`` are its LongRoPE, as in transformers); anything else
raises :class:`UnsupportedModelError`. The scaling is parsed by :mod:`coda.models.rope_scaling`
(HF configs and GGUF files alike) and turned into frequencies in one place,
:mod:`coda.models.rope`.

Phi-3 differs from Llama only in what the checkpoint stores and how RoPE is parameterised: q/k/v
and gate/up come fused (``fused_checkpoint``), LongRoPE's per-frequency factors, and Phi-4-mini's
partial rotary (``rotary_dim`` of ``head_dim`` dimensions rotated, the rest passed through).

Sliding windows (Mistral, Qwen2 with ``use_sliding_window``): attention here is always full
causal attention, which equals sliding-window attention exactly while the context is no longer
than the window. So :attr:`ModelConfig.max_context` is capped at the window and the engine must
never grow a sequence past it.

Gemma 3's local layers are different: their window is applied exactly, per layer, by the paged
attention (:attr:`ModelConfig.local_layers`, :attr:`ModelConfig.local_window`), so it does not
cap the context. Gemma 3 also brings four norms per layer (``sandwich_norms``), a GELU-tanh
gate, embeddings scaled by sqrt(hidden), an attention scale of ``query_pre_attn_scalar ** -0.5``
and its own RoPE base on local layers; HF stores its norm weights as ``w`` applied as ``1 + w``
(``norm_weight_offset`` 1.0) while llama.cpp's GGUF stores ``w + 1`` (offset 0).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coda.models.load_errors import ModelLoadError, UnsupportedModelError
from coda.models.rope_scaling import RopeScaling, hf_rotary_dim, parse_hf_rope

_ARCHS: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
_DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
__all__ = ["DENSE_BY_DTYPE", "ModelConfig", "ModelLoadError", "RopeScaling",
           "UnsupportedModelError", "gemma3_local_layers", "hf_tensor_shapes"]

# NOTE: the dense serving mode (``--quant``, coda/models/modes.py) that runs each dtype; here,
# in a leaf both the mode table and the loader import, so the loader needs no mode table
DENSE_BY_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a decoder-only Llama-family model."""

    arch: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma3" | "phi3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    attention_out_bias: bool  # bias on o_proj (Llama's attention_bias; never for Qwen2)
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str  # "float32" | "bfloat16" | "float16": the checkpoint's dtype
    # NOTE: Gemma 3's differences; the defaults are the Llama family's.
    local_layers: tuple[int, ...] = ()  # layers attending to the last local_window keys only
    local_window: int | None = None  # keys a local layer sees (its own included); exact
    rope_local_theta: float | None = None  # RoPE base of the local layers (None: rope_theta)
    sandwich_norms: bool = False  # norms after attention and MLP too (pre_/post_feedforward)
    hidden_act: str = "silu"  # "silu" | "gelu_tanh": the gate's activation
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size)
    attn_scale: float | None = None  # query scale (None: head_dim ** -0.5)
    norm_weight_offset: float = 0.0  # RMSNorm multiplies by (offset + w)
    # NOTE: Phi-3's differences.
    rotary_dim: int | None = None  # dimensions RoPE rotates (None: head_dim; Phi-4-mini 3/4)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj fused

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``<path>/config.json``; a file that is not a JSON object, or lacks a field the
        architecture needs, is a ModelLoadError naming the file (the CLI's one line, exit 2)."""
        file = Path(path) / "config.json"
        try:
            with open(file, encoding="utf-8") as f:
                d = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{file} cannot be read as JSON: {exc}") from None
        if not isinstance(d, dict):
            raise ModelLoadError(f"{file} is not a JSON object")
        try:
            return cls.from_hf_dict(d)
        except KeyError as exc:
            raise ModelLoadError(f"{file} lacks the field {exc}") from None
        except TypeError as exc:  # NOTE: a field of the wrong JSON type (int(None), a list)
            raise ModelLoadError(f"{file}: a field has the wrong type: {exc}") from None

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Normalise an HF config dict (old ``rope_scaling`` or v5 ``rope_parameters`` style)."""
        archs = d.get("architectures") or []
        arch = next((_ARCHS[a] for a in archs if a in _ARCHS), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architectures {archs!r}; supported: {sorted(_ARCHS)}"
            )
        num_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        head_dim = int(d.get("head_dim") or hidden // num_heads)
        rope_theta, rope_scaling = parse_hf_rope(d, arch)
        rotary_dim = hf_rotary_dim(d, arch, head_dim, rope_scaling)
        sliding = d.get("sliding_window")
        if arch == "qwen2" and not d.get("use_sliding_window", False):
            sliding = None  # NOTE: Qwen2 configs carry a window that is off unless enabled
        eos = d.get("eos_token_id")
        eos_ids = (
            tuple(int(e) for e in eos)
            if isinstance(eos, list)
            else (() if eos is None else (int(eos),))
        )
        dtype = str(d.get("torch_dtype") or d.get("dtype") or "float32")
        if dtype not in _DTYPE_BYTES:
            raise UnsupportedModelError(f"unsupported torch_dtype {dtype!r}")
        bias = bool(d.get("attention_bias", False))
        gemma = _gemma3_fields(d) if arch == "gemma3" else {}
        if gemma:
            rope_theta = gemma.pop("rope_theta")
            sliding = None  # NOTE: applied exactly per layer (local_window), never a cap
            rope_scaling = gemma.pop("rope_scaling")
        return cls(
            arch=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_layers=int(d["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", arch == "gemma3")),
            attention_bias=True if arch == "qwen2" else bias and arch != "phi3",
            attention_out_bias=bias if arch in ("llama", "mistral") else False,  # NOTE: phi3: none
            mlp_bias=bool(d.get("mlp_bias", False)) if arch == "llama" else False,
            qk_norm=arch in ("qwen3", "gemma3"),
            sliding_window=int(sliding) if sliding is not None else None,
            bos_token_id=None if d.get("bos_token_id") is None else int(d["bos_token_id"]),
            eos_token_ids=eos_ids,
            torch_dtype=dtype,
            rotary_dim=rotary_dim,
            fused_checkpoint=arch == "phi3",
            **gemma,
        )

    # ------------------------------------------------------------------ derived values
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_scalars_per_token(self) -> int:
        """T3: the logical cache grows by 2·L·H_kv·d_h scalars per processed token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: str) -> int:
        """Bytes of K/V cache per token when the cache is held in ``dtype``."""
        return self.kv_scalars_per_token * _DTYPE_BYTES[dtype]

    @property
    def max_context(self) -> int:
        """Longest sequence (prompt + output) this engine runs exactly; see module docstring."""
        limit = self.max_position_embeddings
        if self.sliding_window is not None:
            limit = min(limit, self.sliding_window)
        rs = self.rope_scaling
        if rs is not None and (rs.kind == "dynamic" or (rs.kind == "longrope" and not rs.long)):
            limit = min(limit, rs.original_max_position_embeddings)
        return limit

    def serving(self, max_model_len: int | None) -> ModelConfig:
        """This config as served with ``--max-model-len`` (issue 19): a LongRoPE model asked
        for more than its original context serves LongRoPE's long factors (the whole context;
        transformers' numerics for sequences past the original length, which it picks per
        sequence and a paged cache cannot), else the short ones, capped at the original
        length (transformers' numerics there). Every other config is served as it is."""
        rs = self.rope_scaling
        if (max_model_len is None or rs is None or rs.kind != "longrope" or rs.long
                or max_model_len <= rs.original_max_position_embeddings):
            return self
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(rs, long=True))

    def rope_choice(self) -> str | None:
        """The RoPE choice :meth:`serving` made, for the model identity and the load summary
        (None: the file's own numbers)."""
        rs = self.rope_scaling
        if rs is not None and rs.kind == "longrope" and rs.long:
            return (f"LongRoPE long factors (context past the original "
                    f"{rs.original_max_position_embeddings})")
        return None

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head RoPE rotates (the first ones; the rest pass through)."""
        return self.rotary_dim if self.rotary_dim is not None else self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, q, kv, f = self.hidden_size, self.q_size, self.kv_size, self.intermediate_size
        attn = d * q + 2 * d * kv + q * d
        if self.attention_bias:
            attn += q + 2 * kv
        if self.attention_out_bias:
            attn += d
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        norms = (4 if self.sandwich_norms else 2) * d + (2 * self.head_dim if self.qk_norm else 0)
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + emb + d


def gemma3_local_layers(num_layers: int, pattern: int = 6) -> tuple[int, ...]:
    """Gemma 3's layer pattern (transformers' default ``layer_types``, llama.cpp's hard-coded
    one): every ``pattern``-th layer is global, layer ``i`` is local when ``(i + 1) % pattern``."""
    return tuple(i for i in range(num_layers) if (i + 1) % pattern)


def _gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields from an HF config (hub style with ``rope_local_base_freq``, or v5 with
    ``rope_parameters`` per layer type) plus ``rope_theta``/``rope_scaling`` of global layers."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if d.get(key) is not None:
            raise UnsupportedModelError(f"Gemma 3 config with {key}={d[key]} is not supported")
    if d.get("use_bidirectional_attention"):
        raise UnsupportedModelError("Gemma 3 with bidirectional attention is not supported")
    n = int(d["num_hidden_layers"])
    types = d.get("layer_types")
    if types is not None:
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise UnsupportedModelError(f"Gemma 3 layer_types {types!r} not understood")
        local = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    else:
        local = gemma3_local_layers(n, int(d.get("sliding_window_pattern") or 6))
    params = d.get("rope_parameters")
    local_theta = float(d.get("rope_local_base_freq") or 10000.0)
    if isinstance(params, dict) and "full_attention" in params:
        glob, loc = params["full_attention"] or {}, params.get("sliding_attention") or {}
        if (loc.get("rope_type") or "default") != "default":
            raise UnsupportedModelError(f"Gemma 3 local RoPE {loc!r} is not supported")
        local_theta = float(loc.get("rope_theta", local_theta))
        theta, scaling = parse_hf_rope({**d, "rope_parameters": {"rope_theta": 1_000_000.0,
                                                                **glob}, "rope_scaling": None})
    else:
        theta, scaling = parse_hf_rope({"rope_theta": 1_000_000.0, **d})
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise UnsupportedModelError(f"Gemma 3 activation {act!r} is not supported")
    hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
    head_dim = int(d.get("head_dim") or hidden // heads)
    return {
        "rope_theta": theta, "rope_scaling": scaling,
        "local_layers": local, "local_window": int(d.get("sliding_window") or 4096),
        "rope_local_theta": local_theta, "sandwich_norms": True, "hidden_act": "gelu_tanh",
        "embed_scale": True, "norm_weight_offset": 1.0,
        "attn_scale": float(d.get("query_pre_attn_scalar") or head_dim) ** -0.5,
    }


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config holds, by HF name, with its shape."""
    d, q, kv, f, hd = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if cfg.sandwich_norms:
            shapes[p + "pre_feedforward_layernorm.weight"] = (d,)
            shapes[p + "post_feedforward_layernorm.weight"] = (d,)
        if cfg.fused_checkpoint:  # NOTE: Phi-3 stores q/k/v and gate/up as our fused rows
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, d)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            if cfg.fused_checkpoint:
                break
            shapes[p + f"self_attn.{name}.weight"] = (rows, d)
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q)
        if cfg.attention_out_bias:
            shapes[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        mlp = (("gate_up_proj", (2 * f, d)),) if cfg.fused_checkpoint else \
            (("gate_proj", (f, d)), ("up_proj", (f, d)))
        for name, shape in (*mlp, ("down_proj", (d, f))):
            shapes[p + f"mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                shapes[p + f"mlp.{name}.bias"] = (shape[0],)
    shapes["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, d)
    return shapes
