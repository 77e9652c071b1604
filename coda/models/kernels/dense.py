"""Dense (float) linears through the native in-place kernel: the ``fp32-kernel`` mode (issue 18
item 2; T4).

``F.linear`` (BLAS) picks its blocking, and so its summation order, from the batch shape and
the thread count: the same row gives different bits alone and in a crowd (issue 20's D10, 18 of
24 prompts on the default model). Here every projection and the LM head run through
``csrc/kquant_kernels.h`` on their float32 rows read in place (``F32`` segments: the weight
tensor's own memory, no copy): each output is summed in the canonical 16-lane order, so a row's
bits depend on its input row only, whatever the batch, its position in it, the thread count or
the ISA build. The token embeddings stay a float32 table (a gather is exact); norms, RoPE and
attention are the runner's (native rows, also batch-invariant). :mod:`coda.models.dense_invariant`
puts these layers into a model.
"""

from __future__ import annotations

import torch

from coda.models.kernels.kquant_linear import KQuantLinear, Segment

LANE = 16  # NOTE: the kernel's K granularity (csrc/kquant_kernels.h: 16 float lanes)


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> KQuantLinear:
    """``y = x @ weight.T (+ bias)`` through the in-place kernel. ``weight`` is a float32 CPU
    ``[N, K]`` tensor with K a multiple of 16; the layer reads its memory (it must outlive
    the layer: the layer keeps a reference)."""
    w = weight.detach()
    if w.dtype != torch.float32 or w.dim() != 2 or not w.is_cpu:
        raise ValueError(f"weight must be a 2-D float32 CPU tensor, got {w.dtype} {tuple(w.shape)}")
    w = w.contiguous()
    n, k = w.shape
    if k % LANE:
        raise ValueError(f"a {n}x{k} weight: K must be a multiple of {LANE}")
    # NOTE: .numpy() shares the tensor's memory and holds the tensor through its base
    return KQuantLinear([Segment(w.numpy(), "F32", (n, k), bias=bias)])
