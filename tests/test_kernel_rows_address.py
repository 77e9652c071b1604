"""Where a call's rows sit in memory never changes their bits (issues 18, 21; SPEC T4).

The exact block kernel (``csrc/blocks.h`` ``linear_f32``) reads one row in place and packs 2..12
rows into its own 64-byte-aligned buffer first (a decode step's rows, or one sequence's verify
rows: the drafted tokens of exact speculative decoding). So the caller's address (the start of a
view into a larger tensor, aligned to 4 bytes only) must never reach a row's arithmetic: for
M = 1..12 rows starting at any float offset, every row equals its scalar 1-row bits computed
from an aligned copy, on every ISA the CPU runs, for every block kind and both activation modes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models import kernels
from tests.conftest import examples, kernel_isas, using_isa

if (_why := kernels.unavailable()) is not None:  # NOTE: CI sets CODA_REQUIRE_NATIVE (conftest)
    pytest.skip(f"native kernels unavailable: {_why}", allow_module_level=True)

from coda.models.kernels.ggml_linear import KINDS  # noqa: E402
from tests.test_kernel_rows import _bits, _layer, _rows  # noqa: E402


@settings(max_examples=examples(30), deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 27), blocks=st.integers(1, 6),
       offset=st.integers(0, 15), kind=st.sampled_from(sorted(KINDS)),
       act=st.sampled_from(["f32", "q8"]), seed=st.integers(0, 2**16), data=st.data())
def test_t4_rows_at_any_address_give_their_scalar_one_row_bits(
        m: int, n: int, blocks: int, offset: int, kind: str, act: str, seed: int,
        data: st.DataObject) -> None:
    """T4 (property): M = 1..12 rows handed to the kernel as a view starting ``offset`` floats
    into a buffer (so at any 4-byte alignment) give each row the bits that row has alone, on
    the scalar build, from an aligned copy; on any ISA this CPU runs."""
    k = 32 * blocks
    lin = _layer(kind, act, n, k, seed)
    call = lin.direct()  # NOTE: the decoder's path: the caller's pointer as it is
    x = _rows(m, k, seed + 1)
    buf = torch.full((offset + m * k,), float("nan"))
    buf[offset:] = x.reshape(-1)
    view = buf[offset:].view(m, k)
    assert view.data_ptr() % 64 == (buf.data_ptr() + 4 * offset) % 64
    isa = data.draw(st.sampled_from(kernel_isas()), label="isa")
    with using_isa("scalar"):
        want = np.stack([_bits(call(x[i:i + 1].clone()))[0] for i in range(m)])
    with using_isa(isa):
        got = _bits(call(view))
    assert np.array_equal(got, want), (isa, m, offset)
