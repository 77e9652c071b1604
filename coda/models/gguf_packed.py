"""Build :class:`CausalLM` from a llama-architecture GGUF file, exact or packed (issue 10).

Modes (``quant``):

* ``"fp32"`` — every tensor dequantised to float32: exactly the file's weights; the mode the
  exactness tests use.
* ``"q4"`` — Q4_0/Q4_1 matrices stay packed for the int4 CPU kernel (:class:`Int4Linear`);
  the Q8_0 head (the tied token embedding in SmolLM2's file) runs as :class:`Q8Split` (exact
  8-bit values, bfloat16 scales); embeddings, norms, RoPE and attention stay float32. Every
  kernel gives a row the same output whatever the batch: the default serving mode (T4).
* ``"q4-int8head"`` — as ``q4`` with the head requantised per output channel
  (:class:`Int8Linear`): lossy, an opt-in measured by ``benchmarks/bench_vs_llamacpp.py``.
* ``"packed"`` / ``"packed-q8"`` — every Q4_0/Q4_1/Q8_0 matrix, the head included, runs on its
  own GGUF blocks through Coda's AVX2 kernel (:class:`coda.models.kernels.ggml_linear.GgmlLinear`):
  float32 activations times the file's exact weights, or activations quantised per block of 32
  to int8 (lossy, like llama.cpp). Batch-invariant by construction (T4). Where the kernel
  cannot be built or the CPU lacks AVX2, the load logs why and falls back to ``q4``.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` (interleaved RoPE); they are
permuted back here so the model's half-rotation RoPE applies. Rows are whole quantisation
blocks, so the permutation is exact on packed data too.

NOTE: this is the minimum needed for packing and benchmarks; configuration and tokenizer
loading from GGUF metadata belong to the general GGUF loader (issue 9's helper).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coda.models.config import ModelConfig
from coda.models.kernels.ggml_linear import GGML_ACTS, ggml_fallback, ggml_linear
from coda.models.llama import CausalLM
from coda.models.quant import Int4Linear, Int8Linear, Q8Split, dequantize, q4_groups, q8_0_groups

QUANT_MODES = ("fp32", "q4", "q4-int8head", *GGML_ACTS)


def gguf_config(reader: Any) -> ModelConfig:
    """A :class:`ModelConfig` from the ``llama.*`` metadata of an open ``gguf.GGUFReader``."""
    fields = reader.fields

    def val(key: str, default: Any = None) -> Any:
        f = fields.get(key)
        return default if f is None else f.contents()

    if val("general.architecture") != "llama":
        raise ValueError(f"unsupported GGUF architecture {val('general.architecture')!r}")
    names = {t.name for t in reader.tensors}
    return ModelConfig.from_hf_dict({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": int(val("llama.vocab_size") or len(fields["tokenizer.ggml.tokens"].data)),
        "hidden_size": val("llama.embedding_length"),
        "intermediate_size": val("llama.feed_forward_length"),
        "num_hidden_layers": val("llama.block_count"),
        "num_attention_heads": val("llama.attention.head_count"),
        "num_key_value_heads": val("llama.attention.head_count_kv"),
        "rms_norm_eps": val("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": val("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": val("llama.context_length"),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": val("tokenizer.ggml.bos_token_id"),
        "eos_token_id": val("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    })  # fmt: skip


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (per head: interleaved halves -> two halves)."""
    n = rows.shape[0]
    r = rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:])
    return np.ascontiguousarray(r.swapaxes(1, 2).reshape(rows.shape))


class _Tensor:
    """One GGUF matrix as groups: ``w = (code - center) * scale + zero`` per 32 inputs."""

    def __init__(self, t: Any, n_head: int | None = None) -> None:
        kind = t.tensor_type.name
        raw = np.asarray(t.data)
        self.raw = raw if n_head is None else _unpermute(raw, n_head)  # NOTE: whole blocks
        self.shape = tuple(int(v) for v in reversed(t.shape))  # NOTE: GGUF lists (in, out)
        if kind in ("Q4_0", "Q4_1"):
            self.codes, self.scale, self.zero = q4_groups(raw, kind)
            self.center = 8
        elif kind == "Q8_0":
            self.codes, self.scale = q8_0_groups(raw)
            self.zero, self.center = np.zeros_like(self.scale), 0
        elif kind in ("F32", "F16"):
            self.dense = torch.from_numpy(raw.astype(np.float32))
            self.codes = np.empty(0)
        else:
            raise ValueError(f"{t.name}: unsupported GGUF tensor type {kind}")
        self.kind = kind
        if n_head is not None:
            if kind in ("F32", "F16"):
                self.dense = torch.from_numpy(_unpermute(self.dense.numpy(), n_head))
            else:
                self.codes, self.scale, self.zero = (
                    _unpermute(a, n_head) for a in (self.codes, self.scale, self.zero))

    def float(self) -> torch.Tensor:
        if self.kind in ("F32", "F16"):
            return self.dense
        return dequantize(self.codes, self.scale, self.zero, self.center)

    def packed(self, head: str = "q8split") -> nn.Module:
        if self.kind in ("Q4_0", "Q4_1"):
            return Int4Linear(self.codes, self.scale, self.zero)
        if self.kind == "Q8_0" and head == "q8split":
            return Q8Split(self.codes, self.scale)
        return Int8Linear(self.float())


def _cat(parts: list[_Tensor]) -> _Tensor:
    out = parts[0]
    if len(parts) > 1 and out.kind in ("F32", "F16"):
        out.dense = torch.cat([p.float() for p in parts])
    elif len(parts) > 1:
        if len({p.kind for p in parts}) != 1:
            raise ValueError("fused projections need one block type")
        out.codes = np.concatenate([p.codes for p in parts])
        out.scale = np.concatenate([p.scale for p in parts])
        out.zero = np.concatenate([p.zero for p in parts])
        out.raw = np.concatenate([p.raw for p in parts])
        out.shape = (sum(p.shape[0] for p in parts), *out.shape[1:])
    return out


def load_gguf_model(path: str | Path, quant: str = "q4") -> CausalLM:
    """Build and fill the model; ``quant`` is one of :data:`QUANT_MODES`."""
    from gguf import GGUFReader

    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quant mode {quant!r}; use one of {QUANT_MODES}")
    quant = ggml_fallback(quant)
    reader = GGUFReader(str(path))
    cfg = gguf_config(reader)
    tensors = {t.name: t for t in reader.tensors}
    with torch.device("meta"):
        model = CausalLM(cfg)
    model = model.to_empty(device="cpu").float()
    packed = quant != "fp32"
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(_Tensor(tensors["token_embd.weight"]).float())
        model.model.norm.weight.copy_(_Tensor(tensors["output_norm.weight"]).float())
        for i, layer in enumerate(model.model.layers):
            def get(name: str, n_head: int | None = None, i: int = i) -> _Tensor:
                return _Tensor(tensors[f"blk.{i}.{name}.weight"], n_head)
            layer.input_layernorm.weight.copy_(get("attn_norm").float())
            layer.post_attention_layernorm.weight.copy_(get("ffn_norm").float())
            attn, mlp = layer.self_attn, layer.mlp
            mats: dict[str, tuple[nn.Module, str, _Tensor]] = {
                "qkv": (attn, "qkv_proj", _cat([get("attn_q", cfg.num_heads),
                                                get("attn_k", cfg.num_kv_heads), get("attn_v")])),
                "o": (attn, "o_proj", get("attn_output")),
                "gate_up": (mlp, "gate_up_proj", _cat([get("ffn_gate"), get("ffn_up")])),
                "down": (mlp, "down_proj", get("ffn_down")),
            }
            for owner, attr, t in mats.values():
                if (lin := ggml_linear(quant, t.raw, t.kind, t.shape)) is not None:
                    setattr(owner, attr, lin)
                elif packed and t.kind in ("Q4_0", "Q4_1"):
                    setattr(owner, attr, t.packed())
                else:
                    getattr(owner, attr).weight.copy_(t.float())
        head_t = _Tensor(tensors.get("output.weight", tensors["token_embd.weight"]))
        if cfg.tie_word_embeddings is False:
            assert model.lm_head is not None
            model.lm_head.weight.copy_(head_t.float())
        if quant in GGML_ACTS:
            model.logits_head = ggml_linear(quant, head_t.raw, head_t.kind, head_t.shape)
        elif packed:
            model.logits_head = head_t.packed("q8split" if quant == "q4" else "int8")
    model.eval()
    return model
