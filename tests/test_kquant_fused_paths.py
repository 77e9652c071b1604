"""The decode-batch register kernel's special paths (kquant_fused.h; issue 18; SPEC T3, T4).

The AVX2 build computes a Q6_K weight as fma(M + q, a, -M a) (a "magic number" conversion,
exact for a finite scale) and falls back to the plain (d * sc) * q for a super-block whose d is
infinite or NaN; it groups Q4_K outputs two at a time and the other types four at a time. These
tests hold every such path to the portable build's bits, one input row (the register kernel)
and a few (the span kernel), non-finite scales included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.kernels import unavailable
from tests.conftest import examples, kernel_isas, using_isa
from tests.kquant_files import BLOCKS, random_blocks

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.kquant_linear import KQuantLinear, Segment  # noqa: E402

HERE_ISAS = kernel_isas()


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit, except that any NaN equals any NaN (which NaN an FMA passes on when
    two are NaN depends on the instruction form the compiler picked, in every kernel)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def q6_block_of_ones(d: int) -> np.ndarray:
    """One Q6_K super-block whose 256 codes are q = 1 and 16 sub-scales 1, float16 d bits ``d``:
    every weight is d (inf for d = +inf: the plain product; the magic form would give NaN)."""
    blk = np.zeros(210, np.uint8)
    blk[:128] = 0x11       # NOTE: low nibbles 1
    blk[128:192] = 0xAA    # NOTE: high pairs 2: q = (1 | 2 << 4) - 32 = 1
    blk[192:208] = 1
    blk[208:210] = np.array([d], np.uint16).view(np.uint8)
    return blk


@pytest.mark.parametrize("isa", HERE_ISAS)
def test_t3_q6_k_infinite_scale_block_is_the_plain_product_in_every_kernel(isa: str) -> None:
    """T3: a Q6_K super-block with d = +inf gives inf weights (gguf-py's (d * sc) * q), so a
    row over it with positive inputs is +inf in the register kernel (1 row) and the span kernel
    (3 rows), and the other outputs of its group keep the portable build's bits."""
    rng = np.random.default_rng(11)
    n, k = 7, 512
    raw = random_blocks("Q6_K", n, k, rng).reshape(n, 2, 210)
    raw[2, 1] = q6_block_of_ones(0x7C00)
    lin = KQuantLinear([Segment(raw.reshape(n, -1), "Q6_K", (n, k))])
    x = torch.rand(3, k, generator=torch.Generator().manual_seed(12)) + 0.5
    with using_isa("scalar"):
        want = lin(x).numpy()
    assert np.isposinf(want[:, 2]).all() and np.isfinite(np.delete(want, 2, axis=1)).all()
    with using_isa(isa):
        for m in (1, 3):
            assert same_bits(lin(x[:m]).numpy(), want[:m]), m


@settings(max_examples=examples(40), deadline=None)
@given(qtype=st.sampled_from(["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K"]),
       rows=st.integers(1, 9), halves=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_t4_one_row_any_scale_bits_equal_the_portable_build(qtype: str, rows: int,
                                                             halves: list[int], seed: int) -> None:
    """T4: one input row (the register kernel) over 1..9 outputs (every group width and tail)
    gives the portable build's bits on every ISA, whatever the float16 scales (finite, zero,
    subnormal, infinite, NaN) of a few super-blocks."""
    rng = np.random.default_rng(seed)
    k = 512
    per, size, scales = BLOCKS[qtype]
    raw = random_blocks(qtype, rows, k, rng).reshape(rows, k // per, size)
    for i, h in enumerate(halves):
        blk = raw[int(rng.integers(rows)), int(rng.integers(k // per))]
        blk[scales[i % len(scales)]:scales[i % len(scales)] + 2] = \
            np.array([h], np.uint16).view(np.uint8)
    lin = KQuantLinear([Segment(raw.reshape(rows, -1), qtype, (rows, k))])
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(seed))
    with using_isa("scalar"):
        want = lin(x).numpy()
    for isa in HERE_ISAS:
        with using_isa(isa):
            assert same_bits(lin(x).numpy(), want), isa
