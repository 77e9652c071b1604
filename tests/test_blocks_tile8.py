"""The K-blocked tile of the re-laid-out legacy blocks (issue 18 item 3; SPEC T4): on the AVX-512
build, 6..8 and 13..16 rows of a Q4_0, Q4_1 or Q8_0 matrix in the f32 mode run
``csrc/blocks_tile8.h`` (x packed once per call, outputs in blocks of 4 tiles, K in spans of 16
blocks, partial sums parked between spans; 13..16 rows as two groups of 6..8).

Its bits are the scalar build's for every row count 1..16 (the counts it does not take run
``blocks_avx512.h``'s tile, which must agree too), with shapes that exercise the blocking: a
partial last tile (N = 69: outputs 64..68, so passes that write 1 of 2 outputs and passes that
are skipped), a partial last block of tiles (9 tiles: 4, 4, 1), a short last span (K = 1056: 33
blocks, spans of 16, 16, 1), and 1 or 3 threads (ranges that cut blocks). Each row's bits are
also the row's alone, so the batch changes no token (T4), and the kernel writes only its M rows
and N columns (an output buffer with rows after them stays as it was). Every build the CPU has
is checked (AVX2 and scalar take their other paths to the same bits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from coda.models.kernels import native, unavailable
from tests.conftest import kernel_isas, using_isa, using_threads

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.ggml_linear import GgmlLinear  # noqa: E402

KINDS = ["Q4_0", "Q4_1", "Q8_0"]
N, K = 69, 1056


def _lin(kind: str, seed: int) -> GgmlLinear:
    w = np.random.default_rng(seed).standard_normal((N, K)).astype(np.float32)
    return GgmlLinear(quantize(w, GGMLQuantizationType[kind]), kind, N, K, "f32")


def _x(m: int, seed: int) -> torch.Tensor:
    return torch.randn(m, K, generator=torch.Generator().manual_seed(seed))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _call(lin: GgmlLinear, x: torch.Tensor, out: torch.Tensor) -> None:
    """The kernel straight into ``out`` (which may have more rows than x)."""
    kind, q8 = lin._flags
    native().linear(x.data_ptr(), x.shape[0], K, lin.scales.data_ptr(), lin.quants.data_ptr(),
                    N, kind, q8, out.data_ptr())


@pytest.mark.parametrize("kind", KINDS)
def test_t4_one_to_sixteen_rows_give_the_scalar_bits_and_each_row_alone(kind: str) -> None:
    """T4: 1..16 rows of each legacy type (partial tile, block and span): every build's bits
    are the scalar build's, and each row's bits are its bits computed alone."""
    lin = _lin(kind, 21)
    x = _x(16, 22)
    with using_isa("scalar"):
        want = lin(x)
        assert all(_same(lin(x[r:r + 1])[0], want[r]) for r in range(16))
    for isa in kernel_isas():
        with using_isa(isa):
            for m in range(1, 17):
                assert _same(lin(x[:m]), want[:m]), (isa, kind, m)
                # NOTE: the rows in another position of a batch (a shifted window of x)
                assert _same(lin(x[16 - m:]), want[16 - m:]), (isa, kind, m)


@pytest.mark.parametrize("m", [6, 7, 8, 13, 14, 15, 16])
def test_t4_the_tile_writes_only_its_rows_and_columns(m: int) -> None:
    """T4: the tile's row counts write their m rows of N outputs and nothing else: the rows
    after them in a larger output buffer keep their value (the odd-row tiles' last group of
    trees and the last tile's missing outputs write nothing)."""
    lin = _lin("Q4_1", 23)
    x = _x(m, 24)
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        with using_isa(isa):
            out = torch.full((m + 2, N), 7.0)
            _call(lin, x, out)
            assert _same(out[:m], want), (isa, m)
            assert bool((out[m:] == 7.0).all()), (isa, m)


@pytest.mark.parametrize("kind", KINDS)
def test_t4_eight_and_fifteen_rows_on_1_and_3_threads(kind: str) -> None:
    """T4: 8 and 15 rows (one group, two groups) give the scalar bits on 1 and 3 threads,
    whose ranges of tiles cut the blocks of 4 tiles anywhere."""
    lin = _lin(kind, 25)
    x = _x(15, 26)
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        for t in (1, 3):
            with using_threads(t), using_isa(isa):
                assert _same(lin(x[:8]), want[:8]), (isa, t)
                assert _same(lin(x), want), (isa, t)
