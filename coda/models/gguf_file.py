"""A GGUF checkpoint: metadata → :class:`ModelConfig`, tensors by HF name (issue 9 item 1).

The file is read by :mod:`coda.models.gguf_header` (one pass over the header; the tokenizer's
long arrays parsed on first use; tensor bytes are views of one read-only memory map, shared by
every process that maps the file): opening costs milliseconds, and each tensor's bytes stay on
disk until used.
:func:`open_gguf` checks everything that can make a load fail *before* any weight is touched
(architecture, tensor types, tensor names and shapes) and raises
:class:`~coda.models.config.UnsupportedModelError` naming what is missing.

Tensors come out as :class:`GGUFTensor` records in their **stored** form (quantized blocks,
``data`` as numpy bytes) with the HF parameter name they fill and, for Llama's q/k
projections, the row order that undoes llama.cpp's RoPE permutation. Turning them into
floats is a separate step (:func:`coda.models.gguf_weights.dequantize`), so a packed-weight
path can take the records as they are::

    ckpt = open_gguf(path)                 # config + tensor table, nothing dequantized
    for t in ckpt.tensors():               # GGUFTensor(hf_name, qtype, shape, data, row_order)
        w = dequantize(t)                  # float32 [rows, cols] in HF layout, rows reordered

Supported architectures (``general.architecture``): ``llama`` (also SmolLM/SmolLM2, and
Mistral, which llama.cpp stores as ``llama``), ``qwen2``, ``qwen3``, ``gemma3`` (text; its
norms are stored as ``w + 1`` and applied as stored; q/k rows unpermuted; llama.cpp's fixed
local RoPE base 10000 and 6-layer pattern), ``phi3`` (fused ``attn_qkv`` and ``ffn_up`` =
gate and up; partial rotary from ``rope.dimension_count``; q/k rows unpermuted).

RoPE scaling as llama.cpp stores it: ``rope.scaling.type`` ``linear`` (``factor``), ``yarn``
(``factor``, ``original_context_length``, ``yarn_attn_factor`` / ``attn_factor``,
``yarn_beta_fast``, ``yarn_beta_slow``), ``longrope`` (the ``rope_factors_short`` and
``rope_factors_long`` tensors, ``attn_factor``); Llama 3's scaling is the ``rope_freqs``
tensor of per-frequency divisors. The factor tensors become part of the config
(:class:`~coda.models.rope_scaling.RopeScaling`), computed into frequencies by
:mod:`coda.models.rope` like an HF folder's. This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from coda.models.config import (
    ModelConfig,
    UnsupportedModelError,
    gemma3_local_layers,
    hf_tensor_shapes,
)
from coda.models.gguf_header import GGUFFormatError, GGUFHeader, TensorInfo, read_header
from coda.models.rope_scaling import ROPE_TENSORS, gguf_rope_scaling, rope_factor_values

# general.architecture -> ModelConfig.arch
_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
          "gemma3": "gemma3", "phi3": "phi3"}
# Tensor types dequantized at load (gguf.quants implements each in numpy).
SUPPORTED_QTYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                              "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"})
# llama.cpp's general.file_type (LLAMA_FTYPE_*) as a label for `coda models`.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
              10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
              16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# NOTE: Gemma 3's four norms: its ffn_norm is the MLP's input norm, not Llama's second norm.
_GEMMA3_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# NOTE: Phi-3's fused tensors: ffn_up holds gate and up (gate first), attn_qkv q, k and v.
_PHI3_NAMES = {
    **_LAYER_NAMES,
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class GGUFTensor:
    """One stored tensor. ``shape`` is the HF ``[rows, cols]`` (or ``[n]``) shape; ``data`` is
    the reader's memory-mapped view (float array for F32/F16, raw block bytes otherwise);
    ``row_order`` (when not None) is the permutation of rows that recovers HF's layout."""

    gguf_name: str
    hf_name: str
    qtype: str
    shape: tuple[int, ...]
    data: np.ndarray
    row_order: np.ndarray | None

    @property
    def num_elements(self) -> int:
        return int(np.prod(self.shape))


@dataclass(frozen=True)
class GGUFCheckpoint:
    """An opened GGUF file: its metadata, the normalised config and the tensor table."""

    path: Path
    metadata: dict[str, Any]  # every scalar/string key; big arrays stay in ``header``
    config: ModelConfig
    gguf_arch: str
    header: GGUFHeader  # the tokenizer's arrays (parsed on use) and the tensor table

    def field(self, key: str, default: Any = None) -> Any:
        """Any metadata value, arrays included (``tokenizer.ggml.tokens`` …)."""
        return self.header.field(key, default)

    @property
    def quantization(self) -> str:
        ft = self.metadata.get("general.file_type")
        return FILE_TYPES.get(int(ft), f"type {ft}") if ft is not None else _majority_qtype(self)

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor the model uses, by HF name (validated by :func:`open_gguf`)."""
        for t in self.header.tensors:
            hf = hf_name(t.name, self.gguf_arch)
            if hf is None:
                continue
            yield GGUFTensor(t.name, hf, t.type_name, _hf_shape(t), self.header.data(t),
                             _row_order(self.config, self.gguf_arch, hf))


def hf_name(gguf_name: str, gguf_arch: str = "llama") -> str | None:
    """HF parameter name for a GGUF tensor name; None for tensors the model does not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = {"gemma3": _GEMMA3_NAMES, "phi3": _PHI3_NAMES}.get(gguf_arch, _LAYER_NAMES)
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    return None


def _hf_shape(t: TensorInfo) -> tuple[int, ...]:
    # NOTE: GGUF lists dimensions fastest-first (ne0 = columns); HF lists rows first.
    return tuple(reversed(t.dims))


def _row_order(cfg: ModelConfig, gguf_arch: str, name: str) -> np.ndarray | None:
    """llama.cpp stores Llama's q/k rows permuted for its interleaved RoPE: within each head,
    row ``2i + j`` of the file is HF row ``j * d/2 + i``. Qwen files are stored unpermuted."""
    if gguf_arch not in ("llama", "mistral"):
        return None
    if name.endswith("self_attn.q_proj.weight"):
        heads = cfg.num_heads
    elif name.endswith("self_attn.k_proj.weight"):
        heads = cfg.num_kv_heads
    else:
        return None
    half = cfg.head_dim // 2
    # NOTE: HF row (h, j, i) sits at file row (h, i, j); gather file rows in HF order.
    idx = np.arange(heads * cfg.head_dim).reshape(heads, half, 2)
    return idx.transpose(0, 2, 1).reshape(-1)


def _majority_qtype(ckpt: GGUFCheckpoint) -> str:
    counts: dict[str, int] = {}
    for t in ckpt.header.tensors:
        counts[t.type_name] = counts.get(t.type_name, 0) + t.n_elements
    return max(counts, key=counts.__getitem__) if counts else "?"


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str],
                         vocab_size: int | None,
                         rope_tensors: dict[str, tuple[float, ...]] | None = None,
                         ) -> tuple[ModelConfig, str]:
    """Build the ModelConfig from GGUF metadata; returns ``(config, gguf_arch)``.
    ``rope_tensors``: the values of the file's :data:`ROPE_TENSORS` (a name in
    ``tensor_names`` without its values is refused)."""
    arch = str(meta.get("general.architecture", ""))
    if arch not in _ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {sorted(_ARCHS)}")
    name = str(meta.get("general.name", "")).lower()
    kind = "mistral" if arch == "llama" and "mistral" in name else _ARCHS[arch]

    def get(key: str, default: Any = None, required: bool = True) -> Any:
        full = f"{arch}.{key}"
        if full in meta:
            return meta[full]
        if required and default is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {full!r}")
        return default

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise UnsupportedModelError("GGUF key_length != value_length is not supported")
    rope_dim = int(get("rope.dimension_count", head_dim))
    if rope_dim != head_dim and arch != "phi3":
        raise UnsupportedModelError(f"partial RoPE ({rope_dim} of {head_dim} dims) is not supported"
                                    f" for {arch} (only phi3)")
    if rope_dim <= 0 or rope_dim % 2 or rope_dim > head_dim:
        raise UnsupportedModelError(f"GGUF rope.dimension_count {rope_dim} is not usable")
    vocab = int(get("vocab_size", vocab_size))
    ctx = int(get("context_length"))
    factors = rope_factor_values(tensor_names, rope_tensors or {}, rope_dim)
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    gemma = _gemma3_fields(get, heads, hidden, head_dim) if arch == "gemma3" else {}
    cfg = ModelConfig(
        arch=kind,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=gguf_rope_scaling(get, ctx, factors, arch),
        max_position_embeddings=ctx,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        attention_out_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias=False,
        qk_norm=kind in ("qwen3", "gemma3"),
        # NOTE: llama.cpp runs these archs with full attention; Phi-3's window (full attention
        # in llama.cpp too) caps the context as the HF config's does, so both agree
        sliding_window=_phi3_window(get) if arch == "phi3" else None,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        torch_dtype="float32",
        rotary_dim=None if rope_dim == head_dim else rope_dim,
        fused_checkpoint=arch == "phi3",
        **gemma,
    )
    return cfg, arch


def _gemma3_fields(get: Any, heads: int, hidden: int, head_dim: int) -> dict[str, Any]:
    """Gemma 3's differences as llama.cpp reads them: the window from the file; the 6-layer
    pattern, the local RoPE base 10000 and the query scale hard-coded (the 62-layer 27B
    scales by hidden / heads, every other size by head_dim); norms stored as ``w + 1``."""
    n_layers = int(get("block_count"))
    scalar = hidden // heads if n_layers == 62 else head_dim
    return {"local_layers": gemma3_local_layers(n_layers),
            "local_window": int(get("attention.sliding_window")), "rope_local_theta": 10000.0,
            "sandwich_norms": True, "hidden_act": "gelu_tanh", "embed_scale": True,
            "attn_scale": float(scalar) ** -0.5, "norm_weight_offset": 0.0}


def _phi3_window(get: Any) -> int | None:
    window = get("attention.sliding_window", 0, required=False)
    return int(window) if window else None


def open_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open and validate a GGUF file (metadata, tensor names, shapes and types)."""
    path = Path(path)
    try:
        header = read_header(path)
    except GGUFFormatError as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {exc}") from None
    names = {t.name for t in header.tensors}
    rope = {t.name: tuple(float(x) for x in np.asarray(header.data(t), dtype=np.float32))
            for t in header.tensors if t.name in ROPE_TENSORS and t.type_name in ("F32", "F16")}
    cfg, arch = config_from_metadata(header.metadata, names,
                                     header.array_length("tokenizer.ggml.tokens"), rope)
    ckpt = GGUFCheckpoint(path, header.metadata, cfg, arch, header)
    _validate(ckpt)
    return ckpt


def _validate(ckpt: GGUFCheckpoint) -> None:
    want = hf_tensor_shapes(ckpt.config)
    seen: set[str] = set()
    for t in ckpt.header.tensors:
        hf = hf_name(t.name, ckpt.gguf_arch)
        if hf is None:
            if t.name in ROPE_TENSORS:
                continue  # NOTE: read into the config by config_from_metadata
            if t.name.startswith("blk."):
                raise UnsupportedModelError(f"GGUF tensor {t.name!r} has no place in a "
                                            f"{ckpt.config.arch} model")
            continue
        qtype = t.type_name
        if qtype not in SUPPORTED_QTYPES:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name!r} has type {qtype}, which is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_QTYPES))}")
        if hf not in want:
            raise UnsupportedModelError(f"unexpected GGUF tensor {t.name!r} ({hf})")
        if _hf_shape(t) != want[hf]:
            raise UnsupportedModelError(
                f"GGUF tensor {t.name!r}: shape {_hf_shape(t)} != expected {want[hf]}")
        seen.add(hf)
    missing = sorted(set(want) - seen)
    if missing:
        raise UnsupportedModelError(f"GGUF file lacks tensors: {missing[:5]}")
