"""Tiny GGUFs whose tensors mix block types (issue 18): K-quant blocks are random bytes with
finite small float16 scales (gguf-py cannot quantize K types); Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 are
quantized from random weights with ``gguf.quants``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# (weights per block, bytes per block, byte offsets of float16 scales)
BLOCKS: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)), "Q8_0": (32, 34, (0,)), "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
    "Q6_K": (256, 210, (208,)),
}
K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Sub-scale sizes: the float16 scales are drawn so that weights stay O(scale).
_UNIT = {"Q2_K": 15 * 3, "Q3_K": 32 * 4, "Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32}


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator,
                  scale: float = 0.1) -> np.ndarray:
    """Raw row bytes [rows, row bytes] of ``qtype``: random bytes, finite float16 scales."""
    if qtype in ("F32", "F16", "BF16"):
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        if qtype == "F32":
            return w.view(np.uint8)
        if qtype == "F16":
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    per, size, scales = BLOCKS[qtype]
    if qtype not in K_TYPES:
        w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
        return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in scales:
        d = (rng.standard_normal(raw.shape[:2]) * scale / _UNIT[qtype]).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


# GGUF tensor name -> type; the defaults of a Q4_K_M-like mix (llama.cpp: Q4_K, with Q6_K on
# half the attn_v / ffn_down and on the head)
TypeOf = Callable[[str], str]


def q4_k_m(name: str) -> str:
    if name == "output.weight" or name in ("blk.0.attn_v.weight", "blk.1.ffn_down.weight"):
        return "Q6_K"
    return "Q4_K"


H, F, L, NH, NKV, HD = 256, 512, 2, 4, 2, 64
TOKENS = [chr(c) for c in range(33, 127)] + ["Ġ", "Ġt", "<|endoftext|>"]


def write_mixed(path: Path, type_of: TypeOf, *, arch: str = "llama", tied: bool = False,
                seed: int = 0, dims: tuple[int, int, int, int, int, int] | None = None,
                vocab: int = 0) -> Path:
    """A random 2-layer model (hidden 256) whose matrices have ``type_of(gguf name)`` types;
    ``arch="qwen2"`` adds q/k/v biases; ``tied``: no output.weight. ``dims`` = (hidden, FFN,
    layers, heads, KV heads, head dim) for other shapes, ``vocab`` extra plain tokens."""
    H, F, L, NH, NKV, HD = dims or (globals()["H"], globals()["F"], globals()["L"],  # noqa: N806
                                    globals()["NH"], globals()["NKV"], globals()["HD"])
    tokens = TOKENS[:-1] + [f"<x{i}>" for i in range(vocab)] + TOKENS[-1:]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("mixed")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_token_merges(["Ġ t"])
    w.add_eos_token_id(len(tokens) - 1)

    def mat(name: str, rows: int, cols: int) -> None:
        qtype = type_of(name)
        raw = random_blocks(qtype, rows, cols, rng, scale=0.5 / cols ** 0.5 if
                            "token_embd" not in name else 1.0)
        if qtype == "F32":
            w.add_tensor(name, raw.view(np.float32).reshape(rows, cols))
        elif qtype == "F16":
            w.add_tensor(name, raw.view(np.float16).reshape(rows, cols))
        else:
            q = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(name, raw.reshape(rows, -1), raw_dtype=q)

    def vec(name: str, n: int, base: float) -> None:
        w.add_tensor(name, (base + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", len(tokens), H)
    vec("output_norm.weight", H, 1.0)
    if not tied:
        mat("output.weight", len(tokens), H)
    for i in range(L):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", H, 1.0)
        vec(p + "ffn_norm.weight", H, 1.0)
        mat(p + "attn_q.weight", NH * HD, H)
        mat(p + "attn_k.weight", NKV * HD, H)
        mat(p + "attn_v.weight", NKV * HD, H)
        if arch == "qwen2":
            for n, rows in (("q", NH * HD), ("k", NKV * HD), ("v", NKV * HD)):
                vec(p + f"attn_{n}.bias", rows, 0.0)
        mat(p + "attn_output.weight", H, NH * HD)
        mat(p + "ffn_gate.weight", F, H)
        mat(p + "ffn_up.weight", F, H)
        mat(p + "ffn_down.weight", H, F)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A plain Q6_K quantizer (gguf-py has none): per 16 weights an int8 sub-scale of one fp16
    scale per 256, 6-bit codes round to nearest; row bytes [rows, cols / 256 * 210]."""
    rows, cols = w.shape
    sub = w.astype(np.float32).reshape(-1, 16, 16)  # super-blocks x sub-blocks x weights
    step = np.abs(sub).max(-1) / 31  # NOTE: codes -32..31
    d = (step.max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.where(d32 > 0, np.clip(np.rint(step / np.where(d32 > 0, d32, 1)), -128, 127), 0)
    eff = (d32 * sc)[..., None]
    q = np.where(eff != 0, np.clip(np.rint(sub / np.where(eff != 0, eff, 1)), -32, 31), 0)
    q = (q.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 2, 128)
    lo, hi = q & 15, q >> 4
    ql = lo[..., :64] | (lo[..., 64:] << 4)
    qh = hi[..., :32] | (hi[..., 32:64] << 2) | (hi[..., 64:96] << 4) | (hi[..., 96:] << 6)
    out = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64),
                          sc.astype(np.int8).view(np.uint8), d.view(np.uint8).reshape(-1, 2)],
                         axis=1)
    return out.reshape(rows, -1)


def writer_like(reader: gguf.GGUFReader, dst: Path,
                overrides: dict[str, Any] | None = None) -> gguf.GGUFWriter:
    """A writer for ``dst`` with every metadata field of ``reader`` copied (a field named in
    ``overrides`` gets that value, same type); tensors are the caller's."""
    arch = str(reader.fields["general.architecture"].contents())
    w = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        value = (overrides or {}).get(field.name, field.contents())
        w.add_key_value(field.name, value, kind, sub_type=sub)
    return w


def requantize(src: Path, dst: Path, type_of: Callable[[str], str | None]) -> Path:
    """``src`` rewritten with tensor ``name`` re-quantized to ``type_of(name)`` (None: kept as
    stored): its stored weights dequantized by gguf-py, then quantized by gguf-py (Q4_0, Q4_1,
    Q5_0, Q5_1, Q8_0) or :func:`quantize_q6_k`. Metadata and row order are copied unchanged."""
    reader = gguf.GGUFReader(str(src))
    w = writer_like(reader, dst)
    for t in reader.tensors:
        new = type_of(t.name)
        if new is None or new == t.tensor_type.name:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
            continue
        cols = int(t.shape[0])
        dense = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(-1, cols)
        raw = quantize_q6_k(dense) if new == "Q6_K" else \
            gguf.quants.quantize(dense, gguf.GGMLQuantizationType[new])
        w.add_tensor(t.name, raw, raw_dtype=gguf.GGMLQuantizationType[new])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
