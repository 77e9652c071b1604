"""GGUF tensors → float weights → :class:`~coda.models.llama.CausalLM` (issue 9 item 1).

:func:`dequantize` is the one step that turns a stored :class:`GGUFTensor` (F32, F16, BF16,
Q8_0, Q4_0/1, Q5_0/1 and the K-quants ``gguf.quants`` implements) into a float32 tensor in HF
layout, with llama.cpp's q/k row permutation undone. :func:`load_gguf_model` runs it for every
tensor and fills the model through :func:`~coda.models.loader.build_model`. A packed-weight
path replaces :func:`dequantize` (the rows of a quantized tensor are whole blocks along the
input dimension, so ``row_order`` applies to packed rows as well).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from coda.models.gguf_file import GGUFCheckpoint, GGUFTensor, open_gguf
from coda.models.llama import CausalLM
from coda.models.loader import build_model
from coda.models.mapped_pages import release_pages
from coda.models.row_ops import RowOps


def dequantize(t: GGUFTensor) -> torch.Tensor:
    """Float32 ``t.shape`` tensor in HF layout (rows reordered by ``t.row_order``)."""
    if t.qtype in ("F32", "F16"):
        # NOTE: numpy's own widening (exact); ``gguf`` is imported only for block types: its
        # package import is part of every start otherwise (the norms are F32, issue 19 item 2)
        arr = np.asarray(t.data).astype(np.float32, copy=False)
    else:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        # NOTE: gguf returns float32 for every block type (BF16 included)
        arr = gguf_dequantize(np.asarray(t.data), GGMLQuantizationType[t.qtype]).astype(
            np.float32, copy=False)
    arr = arr.reshape(t.shape)
    if t.row_order is not None:
        arr = arr[t.row_order]
    # NOTE: F32 tensors are views of the read-only memory map: copy before torch owns them
    out = torch.from_numpy(np.array(arr, copy=not arr.flags.writeable, order="C"))
    release_pages(t.data)  # NOTE: copied: the map's pages need not stay resident (RSS)
    return out


def dequantized_tensors(ckpt: GGUFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` for every tensor of the checkpoint, one at a time."""
    for t in ckpt.tensors():
        yield t.hf_name, dequantize(t)


def load_gguf_model(
    path: str | Path | GGUFCheckpoint,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    rows: RowOps | None = None,
) -> CausalLM:
    """Open (or take) a GGUF checkpoint and build the model, dequantized to ``dtype``.

    Peak memory is the model in ``dtype`` plus one float32 tensor at a time."""
    ckpt = path if isinstance(path, GGUFCheckpoint) else open_gguf(path)
    return build_model(ckpt.config, dequantized_tensors(ckpt), dtype=dtype, device=device,
                       rows=rows)
