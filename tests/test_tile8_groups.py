"""Batches of 9..32 rows through the 8-row tiles (issue 18; SPEC T4): on the AVX-512 build
``kq_linear`` runs 9..32 input rows of K-quant or legacy-block tensors as groups of 8 rows through
the 8-row tiles (``csrc/kquant_tile8.h``, ``csrc/legacy_tile8.h``), the rest through the kernels of
fewer rows, not through the span kernel (``csrc/kquant_kernels.h``, ``linear``).

Its bits are the scalar build's on every build the CPU has, for row counts that leave no rest (16,
32), a rest of 1 (9, 17, 33: past the grouped range, the span kernel), of 4 (12, the 4-row tiles)
and of 6 (30, the padded tile); each row's bits are its bits alone (the one-row kernel), so a
batch changes no token (T4); and the call writes only its rows of the output buffer.
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

K = 1280  # NOTE: 5 super-blocks, 40 legacy blocks: a short last span in both tiles
MIXES = {"k-quants": [("Q4_K", 37), ("Q6_K", 32)], "legacy": [("Q4_0", 37), ("Q8_0", 3),
                                                              ("Q4_1", 30)]}


def _lin(parts: list[tuple[str, int]], seed: int) -> KQuantLinear:
    rng = np.random.default_rng(seed)
    segs = [Segment(random_blocks(q, r, K, rng, scale=1.0), q, (r, K), rng.permutation(r),
                    torch.from_numpy(rng.standard_normal(r).astype(np.float32)))
            for q, r in parts]
    return KQuantLinear(segs)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("m", [9, 12, 16, 17, 30, 32, 33])
def test_t4_nine_to_thirty_two_rows_give_the_scalar_bits_and_each_row_alone(mix: str,
                                                                           m: int) -> None:
    """T4: m rows give the scalar build's bits on every build, each row its bits alone, and the
    call writes only its m rows of a larger output buffer."""
    lin = _lin(MIXES[mix], 21)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(22))
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        with using_isa(isa):
            assert _same(lin(x), want), (isa, m)
            for r in (0, 8, m - 1):
                assert _same(lin(x[r:r + 1])[0], want[r]), (isa, m, r)
            out = torch.full((m + 3, lin.out_features), 7.0)
            native().kq_linear(x.data_ptr(), m, K, lin._table.data_ptr(), len(lin.segments),
                               out.data_ptr())
            assert _same(out[:m], want), (isa, m)
            assert bool((out[m:] == 7.0).all()), (isa, m)


def test_t4_sixteen_rows_on_3_threads() -> None:
    """T4: 16 rows of the legacy mix on 3 threads (ranges that cut the tiles' output blocks)."""
    lin = _lin(MIXES["legacy"], 23)
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(24))
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        with using_threads(3), using_isa(isa):
            assert _same(lin(x), want), isa
