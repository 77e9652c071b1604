"""Linear layers and embeddings on GGUF tensors read in place, every block type (issue 18; T4).

:class:`KQuantLinear` multiplies float32 activations by one or more GGUF tensors (a fused
projection's parts, each its own block type: Q4_K q/k with a Q6_K v) straight from the file's
memory-mapped row bytes: no re-laid-out or concatenated copy; llama.cpp's q/k row order is
followed through a row map (int32 per output row) instead of moving rows; biases are float32.
:class:`KQuantEmbedding` gathers token rows from the blocks, decoding only the rows asked for.

``act="q8"`` (the ``packed-q8`` mode, K-quant tensors only: :data:`Q8K_TYPES`): each input row
is quantized per 256 to llama.cpp's Q8_K (int8 codes, one scale per block) and multiplied by
the blocks' integer codes exactly (``csrc/kquants_q8.h``: its order is fixed per output, the
same on every ISA).

Numerics (the ``packed`` mode): each weight is decoded bit for bit as
``gguf.quants.dequantize`` (``csrc/kquants.h``, ``csrc/kquants_avx2.h``), and each output is
summed in the canonical order of ``csrc/kquant_kernels.h`` (16 float lanes, input k in lane
k mod 16, FMA in increasing k, a fixed tree), so a row's bits depend on its input row only —
not on the batch, its position or the thread count — and are the same for every build of
``coda._native`` (``CODA_KERNEL_ISA=scalar|avx2|avx512``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from coda.models.kernels import native
from coda.models.kernels.raw import RawLinear, attach

# ggml type name -> (ggml type number, weights per block, bytes per block); csrc/table.h's
TYPES: dict[str, tuple[int, int, int]] = {
    "F32": (0, 1, 4), "F16": (1, 1, 2), "BF16": (30, 1, 2),
    "Q4_0": (2, 32, 18), "Q4_1": (3, 32, 20), "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24),
    "Q8_0": (8, 32, 34), "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144),
    "Q5_K": (13, 256, 176), "Q6_K": (14, 256, 210),
}


Q8K_TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ACTS = ("f32", "q8")


def kernel_name(qtype: str, act: str = "f32") -> str:
    """What runs a tensor of ``qtype`` (for the load summary)."""
    if act == "q8" and qtype in Q8K_TYPES:
        return f"packed-q8k/{native().isa()}"
    return f"packed-f32/{native().isa()}"


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


def _input(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous() \
            or not x.is_cpu:
        raise ValueError(f"x must be a contiguous float32 CPU [M, {k}] tensor")
    return x


class KQuantLinear(nn.Module):
    """``y = x @ W.T (+ b)`` with W the row-concatenation of ``segments`` (same K); ``act``
    ``"q8"``: Q8_K activations (every segment a K-quant type, see the module docstring)."""

    def __init__(self, segments: Sequence[Segment], act: str = "f32") -> None:
        super().__init__()
        if not segments or len({s.cols for s in segments}) != 1:
            raise ValueError("segments must be non-empty and share the input width")
        if act not in ACTS:
            raise ValueError(f"unknown activation mode {act!r}; use one of {ACTS}")
        if act == "q8" and (bad := [s.qtype for s in segments if s.qtype not in Q8K_TYPES]):
            raise ValueError(f"q8 activations need K-quant tensors ({', '.join(Q8K_TYPES)}), "
                             f"got {', '.join(bad)}")
        mod = native()  # NOTE: KernelUnavailable here
        self.act = act
        self._linear: Callable[..., None] = mod.kq_linear_q8 if act == "q8" else mod.kq_linear
        self.segments = list(segments)  # NOTE: keeps the mapped bytes, row maps, biases alive
        self._table = table(self.segments)
        self.in_features = segments[0].cols
        self.out_features = sum(s.rows for s in segments)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features, the layer {self.in_features}")
        flat = x.reshape(-1, self.in_features).float().contiguous()
        return self.direct()(flat).view(*x.shape[:-1], self.out_features)

    def direct(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The kernel call alone, for 2-D contiguous float32 inputs (the native decoder path)."""
        linear, tab, nseg = self._linear, self._table, len(self.segments)
        k, n = self.in_features, self.out_features

        def call(x: torch.Tensor) -> torch.Tensor:
            x = _input(x, k)
            y = torch.empty((x.shape[0], n), dtype=torch.float32)
            linear(x.data_ptr(), x.shape[0], k, tab.data_ptr(), nseg, y.data_ptr())
            return y

        # NOTE: the same call with the table's pointer resolved once (the fused loop's)
        attach(call, RawLinear(linear, (k, tab.data_ptr(), nseg), k, n, (tab,)))
        return call

    def extra_repr(self) -> str:
        kinds = "+".join(s.qtype for s in self.segments)
        return f"{self.in_features}->{self.out_features}, {kinds}, act={self.act}"


class KQuantEmbedding(nn.Module):
    """Token embeddings gathered row by row from a GGUF tensor's blocks (no float32 table)."""

    def __init__(self, segment: Segment) -> None:
        super().__init__()
        self._gather: Callable[..., None] = native().kq_gather
        self.segment = segment
        self._table = table([segment])
        self.num_embeddings, self.embedding_dim = segment.rows, segment.cols

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long().contiguous()
        out = torch.empty((flat.shape[0], self.embedding_dim), dtype=torch.float32)
        self._gather(flat.data_ptr(), flat.shape[0], self._table.data_ptr(), self.embedding_dim,
                     out.data_ptr())
        return out.view(*ids.shape, self.embedding_dim)
