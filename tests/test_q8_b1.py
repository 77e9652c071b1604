"""``packed-q8`` at small batches (issue 18, batch 1; SPEC T4): the SIMD builds' 1-row and 2..9-row
matmuls (``csrc/blocks_q8.h`` for Q4_0/Q4_1/Q8_0, ``csrc/kquants_q8_simd.h`` / ``kquants_q8_row.h`` for the K-quants)
group outputs, share activation loads and prefetch the next weights, but each output keeps one
fixed sequence of float steps. So for every block type, M = 1..9 rows, any output count (ragged
last groups and tiles), any K and any thread count, every output has the scalar build's bits,
and each row alone (a 1-row call) gives the bits it has in the batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.kernels import native, unavailable
from tests.conftest import examples, kernel_isas, using_isa
from tests.kquant_files import random_blocks

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.ggml_linear import GgmlLinear  # noqa: E402
from coda.models.kernels.kquant_linear import Q8K_TYPES, KQuantLinear, Segment  # noqa: E402

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q8_0")
TYPES = BLOCK_TYPES + tuple(Q8K_TYPES)


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.uint32)


def _layer(qtype: str, n: int, blocks: int, seed: int) -> torch.nn.Module:
    """A q8 linear of n outputs over `blocks` of the type's block size (32 or 256 inputs)."""
    rng = np.random.default_rng(seed)
    if qtype in BLOCK_TYPES:
        k = 32 * blocks
        w = rng.standard_normal((n, k)).astype(np.float32)
        return GgmlLinear(quantize(w, GGMLQuantizationType[qtype]), qtype, n, k, "q8")
    k = 256 * blocks
    return KQuantLinear([Segment(random_blocks(qtype, n, k, rng), qtype, (n, k))], act="q8")


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    """m rows of different scales (a row mixed up with another shows), one all-zero block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.logspace(-2, 2, m)[:, None]
    x[m // 2, :32] = 0.0
    return torch.from_numpy(x.astype(np.float32))


@settings(max_examples=examples(40), deadline=None)
@given(qtype=st.sampled_from(TYPES), m=st.integers(1, 9), n=st.integers(1, 41),
       blocks=st.integers(1, 9), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_t4_small_batches_keep_the_scalar_bits_and_each_rows_bits_alone(
        qtype: str, m: int, n: int, blocks: int, threads: int, seed: int) -> None:
    """T4 (property): for every block type, M = 1..9, N = 1..41 and K of 1..9 blocks, on every
    ISA the CPU runs and any thread count, the batch's outputs are the scalar build's bits and
    every row's 1-row call gives its bits in the batch."""
    lin = _layer(qtype, n, blocks, seed)
    k = (32 if qtype in BLOCK_TYPES else 256) * blocks
    x = _rows(m, k, seed + 1)
    with using_isa("scalar"):
        want = _bits(lin(x))
    before = native().threads()
    try:
        native().set_threads(threads)
        for isa in kernel_isas():
            with using_isa(isa):
                assert np.array_equal(_bits(lin(x)), want), (isa, m)
                for r in range(m):
                    assert np.array_equal(_bits(lin(x[r:r + 1].clone()))[0], want[r]), (isa, r)
    finally:
        native().set_threads(before)


@pytest.mark.parametrize("qtype", TYPES)
def test_t4_one_row_over_a_1b_sized_k_has_the_scalar_bits(qtype: str) -> None:
    """T4: the decode step's shape (one row, K = 2048, outputs past several groups and tiles,
    so the next group's prefetch and the steady loop run) gives the scalar build's bits on
    every ISA."""
    blocks = 2048 // (32 if qtype in BLOCK_TYPES else 256)
    lin = _layer(qtype, 45, blocks, seed=5)
    x = _rows(1, 2048, seed=6)
    with using_isa("scalar"):
        want = _bits(lin(x))
    for isa in kernel_isas():
        with using_isa(isa):
            assert np.array_equal(_bits(lin(x)), want), isa
