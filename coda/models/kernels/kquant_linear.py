"""Linear layers and embeddings on GGUF tensors read in place, every block type (issue 18; T4).

:class:`KQuantLinear` multiplies float32 activations by one or more GGUF tensors (a fused
projection's parts, each its own block type: Q4_K q/k with a Q6_K v) straight from the file's
memory-mapped row bytes: no re-laid-out or concatenated copy; llama.cpp's q/k row order is
followed through a row map (int32 per output row) instead of moving rows; biases are float32.
:class:`KQuantEmbedding` gathers token rows from the blocks, decoding only the rows asked for.

Numerics (the ``packed`` mode): each weight is decoded bit for bit as
``gguf.quants.dequantize`` (``kquants.h``), and each output is summed in the canonical order of
``kquant_kernels.h`` (16 float lanes, input k in lane k mod 16, FMA in increasing k, a fixed
tree), so a row's bits depend on its input row only — not on the batch, its position or the
thread count — and are the same for every ISA (``CODA_KERNEL_ISA=scalar|avx2|avx512``).

The kernels are compiled on first use by ``torch.utils.cpp_extension`` (like the other kernels
of this package) until the install-time extension module hosts them.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from coda.models.kernels import KernelUnavailable, cpu_flags

_HERE = Path(__file__).parent
_SOURCES = ("kquant_bind.cpp", "kquants.h", "kquants_avx2.h", "kquant_kernels.h")
ISAS = ("scalar", "avx2", "avx512")
# ggml type name -> (ggml type number, weights per block, bytes per block)
TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}


@functools.cache
def load_ext() -> Any:
    """The compiled kernels; :class:`KernelUnavailable` (with the reason) if they cannot be had."""
    missing = [f for f in ("avx2", "fma", "f16c") if f not in cpu_flags()]
    if missing:
        raise KernelUnavailable(f"CPU lacks {', '.join(missing)} (the JIT build targets AVX2)")
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256(b"".join((_HERE / s).read_bytes() for s in _SOURCES))
        return cpp_extension.load(
            name=f"coda_kquant_{digest.hexdigest()[:10]}", sources=[str(_HERE / _SOURCES[0])],
            extra_include_paths=[str(_HERE)],
            # NOTE: -ffp-contract=off: only the written FMAs fuse (the canonical order's)
            extra_cflags=["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-ffp-contract=off"],
            extra_ldflags=["-fopenmp"], verbose=os.environ.get("CODA_KERNEL_VERBOSE") == "1")
    except (OSError, RuntimeError, ImportError) as exc:
        raise KernelUnavailable(f"could not build {_SOURCES[0]}: {exc}") from exc


def isa() -> str:
    """The ISA the kernels run: ``CODA_KERNEL_ISA`` if set (must be one this CPU has), else the
    widest the CPU has. Every ISA gives the same bits (the canonical order)."""
    best = ISAS[int(load_ext().best_isa())]
    want = os.environ.get("CODA_KERNEL_ISA", "").strip().lower() or best
    if want not in ISAS or ISAS.index(want) > ISAS.index(best):
        raise KernelUnavailable(f"CODA_KERNEL_ISA={want!r}: this CPU runs {ISAS[:ISAS.index(best) + 1]}")
    return want


def kernel_name(qtype: str) -> str:
    """What runs a tensor of ``qtype`` (for the load summary)."""
    return f"packed-f32/{isa()}"


class Segment:
    """One GGUF tensor as the kernel reads it: its row bytes in place, an optional row map
    (output row i reads file row ``row_map[i]``) and an optional float32 bias."""

    def __init__(self, data: np.ndarray, qtype: str, shape: tuple[int, ...],
                 row_order: np.ndarray | None = None, bias: torch.Tensor | None = None) -> None:
        if qtype not in TYPES:
            raise ValueError(f"no kernel for {qtype}; known: {sorted(TYPES)}")
        rows, cols = shape
        number, per_block, size = TYPES[qtype]
        if cols % per_block or cols % 16:
            raise ValueError(f"{qtype} {rows}x{cols}: K must be a multiple of {max(per_block, 16)}")
        self.data = np.ascontiguousarray(data)  # NOTE: the mapped file itself when contiguous
        self.row_bytes = cols // per_block * size
        if self.data.nbytes != rows * self.row_bytes:
            raise ValueError(f"{self.data.nbytes} bytes do not hold a {qtype} {rows}x{cols} matrix")
        self.row_map = None if row_order is None else np.ascontiguousarray(row_order, np.int32)
        if self.row_map is not None and (self.row_map.shape != (rows,) or
                                         self.row_map.min() < 0 or self.row_map.max() >= rows):
            raise ValueError("row_order must be a permutation of the rows")
        self.bias = None if bias is None else bias.detach().float().contiguous()
        if self.bias is not None and self.bias.shape != (rows,):
            raise ValueError(f"bias of shape {tuple(self.bias.shape)} for {rows} rows")
        self.qtype, self.rows, self.cols, self.number = qtype, rows, cols, number

    def entry(self) -> list[int]:
        return [self.data.ctypes.data, self.rows, self.row_bytes, self.number,
                0 if self.row_map is None else self.row_map.ctypes.data,
                0 if self.bias is None else self.bias.data_ptr()]


def table(segments: Sequence[Segment]) -> torch.Tensor:
    return torch.tensor([s.entry() for s in segments], dtype=torch.int64)


class KQuantLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with W the row-concatenation of ``segments`` (same K)."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        super().__init__()
        if not segments or len({s.cols for s in segments}) != 1:
            raise ValueError("segments must be non-empty and share the input width")
        self._ext = load_ext()
        self._isa = ISAS.index(isa())
        self.segments = list(segments)  # NOTE: keeps the mapped bytes, row maps, biases alive
        self._table = table(self.segments)
        self.in_features = segments[0].cols
        self.out_features = sum(s.rows for s in segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {self.in_features}")
        flat = x.reshape(-1, self.in_features).float().contiguous()
        y: torch.Tensor = self._ext.linear(flat, self._table, self._isa)
        return y.view(*x.shape[:-1], self.out_features)

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel call alone, for 2-D contiguous float32 inputs (the native decoder path)."""
        linear, tab, isa_ = self._ext.linear, self._table, self._isa
        return lambda x: linear(x, tab, isa_)

    def extra_repr(self) -> str:
        kinds = "+".join(s.qtype for s in self.segments)
        return f"{self.in_features}->{self.out_features}, {kinds}, isa={ISAS[self._isa]}"


class KQuantEmbedding(nn.Module):
    """Token embeddings gathered row by row from a GGUF tensor's blocks (no float32 table)."""

    def __init__(self, segment: Segment) -> None:
        super().__init__()
        self._ext = load_ext()
        self._isa = ISAS.index(isa())
        self.segment = segment
        self._table = table([segment])
        self.num_embeddings, self.embedding_dim = segment.rows, segment.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long().contiguous()
        out: torch.Tensor = self._ext.gather(flat, self._table, self.embedding_dim, self._isa)
        return out.view(*ids.shape, self.embedding_dim)
