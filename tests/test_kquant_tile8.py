"""The 8-row K-quant tile (issue 18 item 3; SPEC T4): a batch of 6..8 rows runs every K-quant
tensor through one 8-row register tile on the AVX-512 build (``csrc/kquant_tile8.h``: x packed
once per call, 6 or 7 rows padded with zero rows whose outputs are never written; outputs in
blocks, K in spans, partial sums parked between spans).

Its bits are the scalar build's for every K-quant type, with the shapes that exercise the
blocking: more outputs than a block with a partial last block and an odd tail (a one-output
tile), parts of different types whose ends fall inside a block, an odd number of super-blocks
(a short last span), a row map, biases, and 1 or 3 threads (ranges that cut blocks). Each row's
bits are also the row's alone (the one-row kernel), so a batch of 6..8 changes no token (T4), and
a padding row never reaches the output (the rows after the batch stay as they were). Every build
the CPU has is checked (AVX2 and scalar take their other paths to the same bits).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from coda.models.kernels import native, unavailable
from tests.conftest import kernel_isas, using_isa, using_threads
from tests.kquant_files import random_blocks

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.kquant_linear import KQuantLinear, Segment  # noqa: E402

K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
# NOTE: 69 outputs = blocks of 32, 32, 5 (tiles of 2, then 2, 2, 1); K = 1280: 5 super-blocks,
# spans of 4, 1 (a 48 KiB L1d) or 2, 2, 1
N, K, M = 69, 1280, 8


def _lin(parts: list[tuple[str, int]], seed: int) -> KQuantLinear:
    rng = np.random.default_rng(seed)
    segs = [Segment(random_blocks(q, r, K, rng), q, (r, K), rng.permutation(r),
                    torch.from_numpy(rng.standard_normal(r).astype(np.float32)))
            for q, r in parts]
    return KQuantLinear(segs)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_t4_eight_rows_give_the_scalar_bits_and_each_row_alone(qtype: str) -> None:
    """T4: 8 rows of one K-quant type (blocks, tail tile, short span, row map, bias): every
    build's bits are the scalar build's, and each row's are its bits computed alone."""
    lin = _lin([(qtype, N)], 11)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(12))
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        with using_isa(isa):
            assert _same(lin(x), want), isa
            for r in (0, 5, 7):
                assert _same(lin(x[r:r + 1])[0], want[r]), (isa, r)


@pytest.mark.parametrize("m", [5, 6, 7])
def test_t4_six_and_seven_rows_pad_the_tile_and_write_only_their_rows(m: int) -> None:
    """T4: 6 and 7 rows (the padded 8-row tile) and 5 (two row tiles) give the scalar build's
    bits on every build; the padding rows write nothing: a view of the first m rows of a
    larger output buffer leaves the rows after it untouched."""
    lin = _lin([("Q4_K", 37), ("Q6_K", 32)], 15)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(16))
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        with using_isa(isa):
            assert _same(lin(x), want), (isa, m)
            out = torch.full((8, lin.out_features), 7.0)
            native().kq_linear(x.data_ptr(), m, K, lin._table.data_ptr(), len(lin.segments),
                               out.data_ptr())
            assert _same(out[:m], want), (isa, m)
            assert bool((out[m:] == 7.0).all()), (isa, m)


def test_t4_eight_rows_of_mixed_parts_on_1_and_3_threads() -> None:
    """T4: a fused projection whose parts (Q4_K 37, Q6_K 30, Q5_K 3, Q4_K 33) end inside the
    8-row tile's output blocks gives the scalar bits on every build, on 1 and on 3 threads."""
    lin = _lin([("Q4_K", 37), ("Q6_K", 30), ("Q5_K", 3), ("Q4_K", 33)], 13)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(14))
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        for t in (1, 3):
            with using_threads(t), using_isa(isa):
                assert _same(lin(x), want), (isa, t)
