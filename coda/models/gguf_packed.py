"""GGUF tensors kept packed: the builders of the packed serving modes (issue 10; T4).

The checkpoint comes from the one GGUF loader (:func:`coda.models.gguf_file.open_gguf`: config,
tensor table, llama.cpp's q/k row order), exactly as the dense modes get it; only the matrices
are turned into kernel modules instead of float tensors. :func:`build_packed` is the generic
step — a factory turns each (fused) projection's GGUF tensors into a module, another the LM
head, and every other tensor is dequantized into the model by
:func:`coda.models.loader.build_model` — so a new packed mode is two factories.

``q4`` (:func:`build_q4`): Q4_0/Q4_1 projections → :class:`~coda.models.quant.Int4Linear`
(torch's int4 kernel); a Q8_0 head → :class:`~coda.models.quant.Q8Split` (``head="q8split"``)
or the lossy per-channel :class:`~coda.models.quant.Int8Linear` (``head="int8"``); a Q4 head
→ Int4Linear. Numerics: see :data:`coda.models.modes.QUANT_MODES`.

``packed`` / ``packed-q8`` (:func:`build_ggml`, issue 18): every block type. Projections whose
parts are all Q4_0, all Q4_1 or all Q8_0 without bias run on ``csrc/blocks.h`` (re-laid-out once
at load: one copy, as many bytes as those tensors in the file); every other matrix (K-quants,
Q5_0/Q5_1, F16/BF16/F32, a fused projection mixing types, biases) on
:class:`~coda.models.kernels.kquant_linear.KQuantLinear`, which reads the mapped file's rows in
place (q/k order through a row map, fused parts as several tensors' pointers in one call); token
embeddings are gathered from their blocks. Only norms and biases become float32.

Rows of a quantized tensor are whole blocks along the input dimension, so ``row_order``
(llama.cpp's q/k permutation undone) applies to packed rows exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from coda.models.config import UnsupportedModelError, hf_tensor_shapes
from coda.models.gguf_file import GGUFCheckpoint, GGUFTensor
from coda.models.gguf_weights import dequantize
from coda.models.kernels import native
from coda.models.kernels.ggml_linear import GgmlLinear
from coda.models.kernels.kquant_linear import (
    Q8K_TYPES,
    KQuantEmbedding,
    KQuantLinear,
    Segment,
    kernel_name,
)
from coda.models.llama import CausalLM
from coda.models.loader import build_model, param_target
from coda.models.mapped_pages import release_pages
from coda.models.quant import GROUP, Int4Linear, Int8Linear, Q8Split, q4_groups, q8_0_groups
from coda.models.row_ops import RowOps

Q4_TYPES = ("Q4_0", "Q4_1")
Q4_HEAD_TYPES = (*Q4_TYPES, "Q8_0")
# (weights of one fused projection, their biases) -> module
LinearFactory = Callable[[Sequence[GGUFTensor], Sequence[GGUFTensor]], nn.Module]
HeadFactory = Callable[[GGUFTensor], nn.Module]


def projections(ckpt: GGUFCheckpoint) -> dict[str, list[str]]:
    """Our projection module path (``model.layers.0.self_attn.qkv_proj``) → the HF weight
    names it holds, in row order (q, k, v; gate, up)."""
    out: dict[str, list[str]] = {}
    for name, shape in hf_tensor_shapes(ckpt.config).items():
        if len(shape) == 2 and name.endswith("_proj.weight"):
            out.setdefault(param_target(ckpt.config, name)[0].removesuffix(".weight"),
                           []).append(name)
    return out


def head_tensor(tensors: dict[str, GGUFTensor]) -> GGUFTensor:
    return tensors.get("lm_head.weight") or tensors["model.embed_tokens.weight"]


def _rows(t: GGUFTensor, *arrays: np.ndarray) -> list[np.ndarray]:
    return [a if t.row_order is None else a[t.row_order] for a in arrays]


def q4_parts(t: GGUFTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scale, zero) of a Q4_0/Q4_1 tensor in HF row order (see quant.q4_groups)."""
    codes, scale, zero = q4_groups(np.asarray(t.data).reshape(t.shape[0], -1), t.qtype)
    c, s, z = _rows(t, codes, scale, zero)
    return c, s, z


def _copied(parts: Sequence[GGUFTensor]) -> None:
    """The parts now live in a module's own copy: their mapped pages need not stay resident
    (coda.models.mapped_pages; a part also read in place, a tied embedding, faults back only
    the rows it reads)."""
    for t in parts:
        release_pages(t.data)


def _bias(biases: Sequence[GGUFTensor]) -> torch.Tensor | None:
    return torch.cat([dequantize(b) for b in biases]) if biases else None


def int4_linear(parts: Sequence[GGUFTensor], biases: Sequence[GGUFTensor]) -> nn.Module:
    """One Int4Linear over the fused rows of Q4_0/Q4_1 tensors."""
    groups = [q4_parts(t) for t in parts]
    codes, scale, zero = (np.concatenate([g[i] for g in groups]) for i in range(3))
    return Int4Linear(codes, scale, zero, _bias(biases))


def q4_head(head: str) -> HeadFactory:
    def make(t: GGUFTensor) -> nn.Module:
        if t.qtype in Q4_TYPES:
            return int4_linear([t], [])
        if head == "int8":
            return Int8Linear(dequantize(t))
        values, scale = q8_0_groups(np.asarray(t.data).reshape(t.shape[0], -1))
        v, s = _rows(t, values, scale)
        return Q8Split(v, s)

    return make


def build_packed(ckpt: GGUFCheckpoint, make_linear: LinearFactory, make_head: HeadFactory,
                 device: str = "cpu", extra: dict[str, nn.Module] | None = None,
                 rows: RowOps | None = None) -> CausalLM:
    """The model with every projection and the head built by the factories, and ``extra``
    modules by path (the token embeddings of the packed modes); the remaining tensors (norms,
    and embeddings unless given) dequantized to float32. Nothing dense is allocated for what
    the factories replace."""
    tensors = {t.hf_name: t for t in ckpt.tensors()}
    modules: dict[str, nn.Module] = dict(extra or {})
    covered = {f"{path}.weight" for path in modules}
    for path, names in projections(ckpt).items():
        biases = [tensors[b] for n in names if (b := n.removesuffix("weight") + "bias") in tensors]
        modules[path] = make_linear([tensors[n] for n in names], biases)
        covered.update(names, (b.hf_name for b in biases))
    modules["logits_head"] = make_head(head_tensor(tensors))
    covered.add("lm_head.weight")
    rest = ((n, dequantize(t)) for n, t in tensors.items() if n not in covered)
    return build_model(ckpt.config, rest, dtype="float32", device=device, modules=modules,
                       rows=rows)


GGML_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the re-laid-out kernel (csrc/blocks.h)
# Types the in-place kernel (kquant_kernels.h) reads; keep in step with kquant_linear.TYPES.
INPLACE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K",
                 "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")
_BLOCK = {"F32": 16, "F16": 16, "BF16": 16, "Q2_K": 256, "Q3_K": 256, "Q4_K": 256, "Q5_K": 256,
          "Q6_K": 256}  # NOTE: weights per block (32 for the rest); K must be a multiple


def _raw_rows(t: GGUFTensor) -> np.ndarray:
    """A block-quantized tensor's row bytes ``[rows, row bytes]`` in HF row order."""
    raw = np.asarray(t.data).reshape(t.shape[0], -1)
    return raw if t.row_order is None else raw[t.row_order]


def _legacy(parts: Sequence[GGUFTensor], biases: Sequence[GGUFTensor]) -> bool:
    """Whether ``blocks.h``' kernel takes the projection: one of its types, no bias."""
    return not biases and len({t.qtype for t in parts}) == 1 and parts[0].qtype in GGML_TYPES


def segment(t: GGUFTensor, bias: GGUFTensor | None = None) -> Any:
    """``t`` as the in-place kernel reads it: the mapped bytes, llama.cpp's row order as a
    row map (no rows moved), the bias (a small vector) in float32."""
    return Segment(np.asarray(t.data), t.qtype, t.shape, t.row_order,
                   None if bias is None else dequantize(bias))


def _note(kernels: dict[str, str], qtype: str, kernel: str) -> None:
    """Record that ``kernel`` runs (some) ``qtype`` tensors; a type may run on two."""
    have = kernels.get(qtype)
    if have is None or kernel not in have.split(" + "):
        kernels[qtype] = kernel if have is None else f"{have} + {kernel}"


def ggml_linear(act: str, kernels: dict[str, str] | None = None) -> LinearFactory:
    """Projections on their own GGUF blocks (``packed*`` modes): Q4_0/Q4_1/Q8_0 projections
    without bias through ``csrc/blocks.h`` (re-laid-out once, as many bytes as the file; f32 or q8
    activations), every other one (K-quants, Q5, F16, mixed types, biases) through the in-place
    kernel (float32 activations in both modes). ``kernels`` collects type -> kernel."""

    def make(parts: Sequence[GGUFTensor], biases: Sequence[GGUFTensor]) -> nn.Module:
        if _legacy(parts, biases):
            kind = parts[0].qtype
            if kernels is not None:
                _note(kernels, kind, f"blocks-{act}/{native().isa()} (re-laid-out)")
            # NOTE: the parts' rows go straight from the mapped file into the kernel's layout
            raws = [_raw_rows(t) for t in parts]
            module = GgmlLinear(raws, kind, sum(t.shape[0] for t in parts), parts[0].shape[1],
                                act)
            _copied(parts)
            return module
        by_name = {b.hf_name.removesuffix("bias"): b for b in biases}
        segs = [segment(t, by_name.get(t.hf_name.removesuffix("weight"))) for t in parts]
        # NOTE: Q8_K activations where every part is a K-quant; else float32 for all parts
        kact = "q8" if act == "q8" and all(t.qtype in Q8K_TYPES for t in parts) else "f32"
        for t in parts:
            if kernels is not None:
                extra = " (no q8 kernel: float32 activations)" if act != kact else ""
                _note(kernels, t.qtype, f"{kernel_name(t.qtype, kact)} (in place){extra}")
        return KQuantLinear(segs, kact)

    return make


def ggml_head(act: str, kernels: dict[str, str] | None = None) -> HeadFactory:
    def make(t: GGUFTensor) -> nn.Module:
        return ggml_linear(act, kernels)([t], [])

    return make


def _fits(t: GGUFTensor) -> str | None:
    if t.qtype not in INPLACE_TYPES:
        return f"{t.gguf_name} is {t.qtype}; packed runs {', '.join(INPLACE_TYPES)}"
    if t.shape[-1] % _BLOCK.get(t.qtype, 32):
        return f"{t.gguf_name} ({t.qtype}) has {t.shape[-1]} columns, not whole blocks"
    return None


def _matrices(ckpt: GGUFCheckpoint) -> list[GGUFTensor]:
    tensors = {t.hf_name: t for t in ckpt.tensors()}
    mats = [tensors[n] for names in projections(ckpt).values() for n in names]
    return mats + [head_tensor(tensors), tensors["model.embed_tokens.weight"]]


def ggml_applies(ckpt: GGUFCheckpoint) -> str | None:
    """None if the ``packed`` modes can serve the file, else why not: every projection, the
    head and the token embeddings must be of a type the kernels read."""
    mats = _matrices(ckpt)
    for t in mats:
        if (why := _fits(t)) is not None:
            return why
    if all(t.qtype in FLOAT_TYPES for t in mats):
        # NOTE: a float file is the dense invariant mode's (fp32-kernel): same kernel, its name
        # says what the user gets (the file's weights exactly, no quantization)
        return (f"{mats[0].gguf_name} is {mats[0].qtype}, and no matrix is block-quantized: "
                "a float GGUF is served by fp32-kernel (or fp32)")
    return None


def float_applies(ckpt: GGUFCheckpoint) -> str | None:
    """None if ``fp32-kernel`` can serve the GGUF: every matrix F32/F16/BF16, whole lanes."""
    for t in _matrices(ckpt):
        if t.qtype not in FLOAT_TYPES:
            return f"{t.gguf_name} is {t.qtype}: a quantized file is served by packed or q4"
        if (why := _fits(t)) is not None:
            return why
    return None


def build_ggml(ckpt: GGUFCheckpoint, act: str = "f32", device: str = "cpu",
               floats: bool = False, rows: RowOps | None = None) -> CausalLM:
    """The ``packed`` (``act="f32"``) and ``packed-q8`` (``act="q8"``) models, and with
    ``floats`` the ``fp32-kernel`` model of a float GGUF (same kernels). Token embeddings
    are gathered from their blocks (:class:`KQuantEmbedding`); ``model.kernels`` says which
    kernel runs each tensor type (the load summary shows it)."""
    why = float_applies(ckpt) if floats else ggml_applies(ckpt)
    if why is not None:
        raise UnsupportedModelError(why)
    kernels: dict[str, str] = {}
    embed = next(t for t in ckpt.tensors() if t.hf_name == "model.embed_tokens.weight")
    extra: dict[str, nn.Module] = {"model.embed_tokens": KQuantEmbedding(segment(embed))}
    model = build_packed(ckpt, ggml_linear(act, kernels), ggml_head(act, kernels), device, extra,
                         rows)
    kernels[f"{embed.qtype} embeddings"] = "row gather (in place)"
    model.kernels = dict(sorted(kernels.items()))
    return model


def q4_applies(ckpt: GGUFCheckpoint) -> str | None:
    """None if ``q4`` can serve the file, else why not (first offending tensor)."""
    tensors = {t.hf_name: t for t in ckpt.tensors()}
    for path, names in projections(ckpt).items():
        for n in names:
            if tensors[n].qtype not in Q4_TYPES:
                return f"{tensors[n].gguf_name} is {tensors[n].qtype}; q4 needs Q4_0/Q4_1 " \
                       f"projections"
        rows = sum(tensors[n].shape[0] for n in names)
        if rows % 16:
            return f"{path} has {rows} rows; the int4 kernel needs a multiple of 16"
    head = head_tensor(tensors)
    if head.qtype not in Q4_HEAD_TYPES:
        return f"{head.gguf_name} (the LM head) is {head.qtype}; q4 needs Q4_0/Q4_1/Q8_0"
    if head.shape[0] % 16 or head.shape[1] % GROUP:
        return f"the LM head's shape {head.shape} does not fit the int4 kernel (N % 16, K % 32)"
    return None


def build_q4(ckpt: GGUFCheckpoint, head: str = "q8split", device: str = "cpu",
             rows: RowOps | None = None) -> CausalLM:
    """The ``q4`` (``head="q8split"``) and ``q4-int8head`` (``head="int8"``) models."""
    why = q4_applies(ckpt)
    if why is not None:
        raise UnsupportedModelError(why)
    return build_packed(ckpt, int4_linear, q4_head(head), device, rows=rows)

