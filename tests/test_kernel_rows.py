"""Multi-row tile calls of the GGUF block kernel (issues 18, 21; SPEC T4): a decode step of
``1 + k`` rows (speculative verification) runs each output tile for up to 12 rows in one call
(``csrc/blocks.h`` ``linear_f32``: the tile's weights decoded once for all of them, the rows
packed per block, ``ceil(M / 12)`` near-equal calls per tile; AVX2 and scalar: 1 and 2 rows in
registers, 3 and 4 rows in registers by half-lane passes over K chunks of <= 42 / 32 blocks
(``csrc/blocks_rows.h``), and from 5 rows ``csrc/blocks_gemm.h``: the tile decoded once per K
chunk of <= 20 blocks into a buffer, then groups of <= 6 rows). Which call or group a row lands
in, how many rows share it, where it sits and how K is chunked must never change its bits: every
batch of 1..16 rows, at any offset, and of 1..33 rows over K of one to three chunks, gives each
row exactly its bits alone on the portable (scalar) build, on every ISA the CPU runs, for every
block kind and both activation modes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models import kernels
from tests.conftest import examples, kernel_isas, using_isa

if (_why := kernels.unavailable()) is not None:  # NOTE: CI sets CODA_REQUIRE_NATIVE (conftest)
    pytest.skip(f"native kernels unavailable: {_why}", allow_module_level=True)

from coda.models.kernels.ggml_linear import KINDS, GgmlLinear  # noqa: E402

ROWS = 16  # NOTE: one call of 1..12 rows or two (13..16) on AVX-512, up to four elsewhere


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().numpy().view(np.uint32)


def _layer(kind: str, act: str, n: int, k: int, seed: int) -> GgmlLinear:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return GgmlLinear(quantize(w, GGMLQuantizationType[kind]), kind, n, k, act)


def _rows(m: int, k: int, seed: int) -> torch.Tensor:
    """m rows of different scales (so a row mixed up with another shows), one all-zero block."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.logspace(-3, 3, m)[:, None]
    x[m // 2, :32] = 0.0
    return torch.from_numpy(x.astype(np.float32))


def _alone(lin: GgmlLinear, x: torch.Tensor) -> np.ndarray:
    """Each row computed by itself on the scalar build: the reference bits."""
    with using_isa("scalar"):
        return np.stack([_bits(lin(x[i:i + 1]))[0] for i in range(x.shape[0])])


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_t4_every_batch_of_1_to_16_rows_gives_each_rows_bits_alone_on_every_isa(
        kind: str, act: str) -> None:
    """T4: for M = 1..16 and every offset of the M rows in a 16-row pool, each output row is
    bit-identical to that row alone on the scalar build, on every ISA (a ragged last tile:
    N = 27; K = 5 blocks)."""
    n, k = 27, 160
    lin = _layer(kind, act, n, k, seed=3)
    x = _rows(ROWS, k, seed=4)
    want = _alone(lin, x)
    for isa in kernel_isas():
        with using_isa(isa):
            for m in range(1, ROWS + 1):
                for start in range(ROWS - m + 1):
                    got = _bits(lin(x[start:start + m]))
                    assert np.array_equal(got, want[start:start + m]), (isa, m, start)


@settings(max_examples=examples(25), deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 41), blocks=st.integers(1, 7),
       kind=st.sampled_from(sorted(KINDS)), act=st.sampled_from(["f32", "q8"]),
       seed=st.integers(0, 2**16), data=st.data())
def test_t4_a_rows_bits_do_not_depend_on_its_call_or_neighbours(
        m: int, n: int, blocks: int, kind: str, act: str, seed: int,
        data: st.DataObject) -> None:
    """T4 (property): any batch of up to 20 rows in any order (so any split into tile calls and
    any place in a call), on any ISA the CPU runs, gives each row its scalar bits alone."""
    k = 32 * blocks
    lin = _layer(kind, act, n, k, seed)
    x = _rows(m, k, seed + 1)
    order = data.draw(st.permutations(list(range(m))), label="order")
    isa = data.draw(st.sampled_from(kernel_isas()), label="isa")
    want = _alone(lin, x)
    with using_isa(isa):
        got = _bits(lin(x[list(order)]))
    assert np.array_equal(got, want[list(order)])


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize("blocks", [1, 20, 21, 48, 65])
def test_t4_every_batch_of_1_to_33_rows_over_k_chunks_gives_each_rows_bits_alone(
        kind: str, blocks: int) -> None:
    """T4: M = 1..33 rows (register tiles up to 4 rows; from 5, buffered groups of <= 6 rows:
    1..6 groups of every size) over K of 1, 20, 21, 48 and 65 blocks (one, two and three K
    chunks of the buffered path and of the 3- and 4-row passes, the lanes carried between them)
    give each row its scalar bits alone,
    f32 mode, on every ISA (a ragged last tile: N = 13)."""
    n, k = 13, 32 * blocks
    lin = _layer(kind, "f32", n, k, seed=blocks)
    x = _rows(33, k, seed=blocks + 1)
    want = _alone(lin, x)
    for isa in kernel_isas():
        with using_isa(isa):
            for m in range(1, 34):
                assert np.array_equal(_bits(lin(x[:m])), want[:m]), (isa, m)
