"""Decode batches of K-quant rows: the decoded-tile GEMM (kquant_gemm.h; issue 18; SPEC T4).

From a few rows up the AVX2 build decodes each tile of K-quant outputs once into a float buffer
and runs the rows as a small float GEMM (two passes of 8 lanes, K in chunks whose lanes wait in
memory). These tests hold it to the contract of T4: a row's output bits do not depend on how
many rows the call has (1..12: the one-row register kernel, the span kernel, the GEMM in every
row grouping and K chunking), on the thread count, nor on the ISA (the portable scalar build).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.kernels import unavailable
from tests.conftest import examples, kernel_isas, using_isa, using_threads
from tests.kquant_files import BLOCKS, K_TYPES, random_blocks

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.kquant_linear import KQuantLinear, Segment  # noqa: E402

HERE_ISAS = kernel_isas()
# NOTE: 1, 3, 5 super-blocks: one K chunk, and several of unequal size at 5..12 rows
KS = (256, 768, 1280)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal bit for bit; any NaN equals any NaN (which NaN an FMA passes on is the compiler's)."""
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def segment(qtype: str, rows: int, k: int, rng: np.random.Generator, bias: bool) -> Segment:
    raw = random_blocks(qtype, rows, k, rng)
    b = torch.from_numpy(rng.standard_normal(rows).astype(np.float32)) if bias else None
    return Segment(raw, qtype, (rows, k), bias=b)


def each_row_alone(lin: KQuantLinear, x: torch.Tensor) -> np.ndarray:
    return np.concatenate([lin(x[i:i + 1]).numpy() for i in range(x.shape[0])])


def check_rows(lin: KQuantLinear, x: torch.Tensor) -> None:
    """Every ISA's M-row call equals, bit for bit, each row alone and the scalar build's."""
    with using_isa("scalar"):
        want = each_row_alone(lin, x)
    for isa in HERE_ISAS:
        with using_isa(isa):
            got = lin(x).numpy()
            assert same_bits(got, want), (isa, x.shape[0])
            assert same_bits(each_row_alone(lin, x), want), isa


@settings(max_examples=examples(60), deadline=None)
@given(qtype=st.sampled_from(K_TYPES), m=st.integers(1, 12), n=st.integers(1, 11),
       k=st.sampled_from(KS), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_t4_rows_1_to_12_bits_equal_one_row_and_the_portable_build(
        qtype: str, m: int, n: int, k: int, bias: bool, seed: int) -> None:
    """T4: for every K type, 1..12 input rows over 1..11 outputs (full and tail tiles), K of
    one to five super-blocks, with or without bias: each row's outputs have the bits of that row
    alone and of the scalar build, on every ISA this CPU runs."""
    rng = np.random.default_rng(seed)
    lin = KQuantLinear([segment(qtype, n, k, rng, bias)])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    check_rows(lin, x)


@settings(max_examples=examples(40), deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from(K_TYPES), st.integers(1, 9), st.booleans()),
                      min_size=2, max_size=4),
       m=st.integers(1, 12), k=st.sampled_from(KS), seed=st.integers(0, 2**16))
def test_t4_mixed_type_fused_segments_any_row_count(
        parts: list[tuple[str, int, bool]], m: int, k: int, seed: int) -> None:
    """T4: a fused projection of segments of different K types (a tile never spans two; the
    prefetch of the next tile does) gives each row the bits of the row alone and of the scalar
    build, 1..12 rows."""
    rng = np.random.default_rng(seed)
    lin = KQuantLinear([segment(t, n, k, rng, b) for t, n, b in parts])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    check_rows(lin, x)


@settings(max_examples=examples(30), deadline=None)
@given(qtype=st.sampled_from(K_TYPES), m=st.integers(5, 12),
       halves=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=4),
       seed=st.integers(0, 2**16))
def test_t4_rows_any_scale_bits_equal_the_portable_build(
        qtype: str, m: int, halves: list[int], seed: int) -> None:
    """T4 (and T3's non-finite scales): with a few super-blocks' float16 scales set to any bits
    (zero, subnormal, infinite, NaN; Q6_K's infinite d takes the plain product, per output),
    5..12 rows still give each row's one-row and scalar bits."""
    rng = np.random.default_rng(seed)
    n, k = 7, 768
    per, size, scales = BLOCKS[qtype]
    raw = random_blocks(qtype, n, k, rng).reshape(n, k // per, size)
    for i, h in enumerate(halves):
        blk = raw[int(rng.integers(n)), int(rng.integers(k // per))]
        at = scales[i % len(scales)]
        blk[at:at + 2] = np.array([h], np.uint16).view(np.uint8)
    lin = KQuantLinear([Segment(raw.reshape(n, -1), qtype, (n, k))])
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    check_rows(lin, x)


@pytest.mark.parametrize("qtype", K_TYPES)
def test_t4_rows_bits_do_not_depend_on_the_thread_count(qtype: str) -> None:
    """T4: 8 rows over 70 outputs (the pool splits them into tiles differently per thread
    count): the same bits on 1, 2 and 3 threads."""
    rng = np.random.default_rng(5)
    lin = KQuantLinear([segment(qtype, 70, 1024, rng, True)])
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(6))
    with using_threads(1):
        want = lin(x).numpy()
    for t in (2, 3):
        with using_threads(t):
            assert same_bits(lin(x).numpy(), want), t
