"""The in-place register kernel of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows (csrc/legacy_inplace.h; issue 18;
SPEC T3, T4).

``kq_linear`` on legacy-block segments of 1..LEGACY_M input rows (AVX-512: 8, AVX2: 4) decodes
each output's ggml blocks from the file's bytes straight into registers (AVX-512 at 6..8 rows:
csrc/legacy_tile8.h's 8-row tile, K-blocked, one decode for the 8 rows). Its bits must be the
portable build's (the span kernel) and the re-laid-out tile's (``GgmlLinear``, csrc/blocks.h:
the same canonical order, so a tensor may run either way) on every ISA, for every row count
(1..4 rows per call, 5..8 as two calls or the 8-row tile, then the span kernel or, AVX-512,
the 8-row tile and the rest: tests/test_tile8_groups.py), partial groups
of outputs (N = 69: groups of 4, then 1; the tile's pairs, then 1), a short K and two long ones
(1056: the tile's spans of 32 blocks, then one, or of 16, 16, 1 where L1d is under 48 KiB;
1664: 32, then 20, the span's scales gathered 16 blocks at a time, the last gather partial),
1 and 3 threads; each row's bits are its bits
alone (T4); row maps, biases and fused segments of mixed legacy types keep them; any float16
scale (zero, subnormal, infinite, NaN) gives the portable build's weights; the kernel writes
only its M rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.kernels import unavailable
from tests.conftest import examples, kernel_isas, using_isa, using_threads
from tests.kquant_files import BLOCKS, random_blocks

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels import native  # noqa: E402
from coda.models.kernels.ggml_linear import GgmlLinear  # noqa: E402
from coda.models.kernels.kquant_linear import KQuantLinear, Segment, table  # noqa: E402

KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
RELAID = {"Q4_0", "Q4_1", "Q8_0"}  # NOTE: the kinds blocks.h re-lays out (GgmlLinear)
HERE_ISAS = kernel_isas()
N = 69  # NOTE: 17 groups of 4 outputs and one of 1 (every tile width's tail)


def same_bits(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    """Equal bit for bit; any NaN equals any NaN (which NaN an FMA passes on is the
    instruction form's choice, in every kernel; see tests/test_kquant_fused_paths.py)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def _raw(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    return random_blocks(kind, n, k, np.random.default_rng(seed), scale=1.0)


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k", [32, 1056, 1664])
@pytest.mark.parametrize("kind", KINDS)
def test_t4_one_to_ten_rows_in_place_give_the_scalar_and_relaid_bits(kind: str, k: int) -> None:
    """T4: 1..10 rows (one call of 1..4, two calls, past LEGACY_M the span kernel or the tile
    and the rest) of an in-place
    Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 matrix give, on every ISA, the portable build's bits and the re-laid-out
    tile's (blocks.h; Q4_0, Q4_1, Q8_0) on the same file bytes; each row's bits are its bits alone and in another
    position of the batch."""
    raw = _raw(kind, N, k, 31 + k)
    inplace = KQuantLinear([Segment(raw, kind, (N, k))])
    relaid = GgmlLinear(raw, kind, N, k, "f32") if kind in RELAID else None
    x = _x(10, k, 32)
    with using_isa("scalar"):
        want = inplace(x)
        assert relaid is None or same_bits(relaid(x), want), "the scalar build's two kernels"
        assert all(same_bits(inplace(x[r:r + 1])[0], want[r]) for r in range(10))
    for isa in HERE_ISAS:
        with using_isa(isa):
            for m in range(1, 11):
                assert same_bits(inplace(x[:m]), want[:m]), (isa, m)
                assert same_bits(inplace(x[10 - m:]), want[10 - m:]), (isa, m)
            assert relaid is None or same_bits(relaid(x[:1]), want[:1]), isa


@pytest.mark.parametrize("kind", KINDS)
def test_t4_row_map_bias_and_mixed_legacy_segments_keep_the_bits(kind: str) -> None:
    """T4: a fused projection of three legacy segments (this kind with a row map, the other two
    kinds, one with a bias; segment boundaries inside groups of 4) gives the portable build's
    bits on every ISA at 1..8 rows and 1 or 3 threads, and its rows are the segments' own."""
    k = 320
    rng = np.random.default_rng(41)
    # NOTE: the next two kinds (cyclically): every kind fused with two others, Q5_0 with Q8_0
    # (Gemma 3's fused q/k/v)
    i = KINDS.index(kind)
    others = [KINDS[(i + 1) % len(KINDS)], KINDS[(i + 2) % len(KINDS)]]
    sizes = {kind: 13, others[0]: 22, others[1]: 7}
    raws = {t: _raw(t, n, k, 42 + i) for i, (t, n) in enumerate(sizes.items())}
    perm = rng.permutation(sizes[kind]).astype(np.int32)
    bias = torch.randn(sizes[others[0]], generator=torch.Generator().manual_seed(43))
    segs = [Segment(raws[kind], kind, (sizes[kind], k), row_order=perm),
            Segment(raws[others[0]], others[0], (sizes[others[0]], k), bias=bias),
            Segment(raws[others[1]], others[1], (sizes[others[1]], k))]
    lin = KQuantLinear(segs)
    x = _x(8, k, 44)
    with using_isa("scalar"):
        want = lin(x)
        alone = KQuantLinear([Segment(raws[kind][perm], kind, (sizes[kind], k))])(x)
        assert same_bits(want[:, :sizes[kind]], alone), "the row map reads file row perm[i]"
    for isa in HERE_ISAS:
        for t in (1, 3):
            with using_threads(t), using_isa(isa):
                for m in range(1, 9):
                    assert same_bits(lin(x[:m]), want[:m]), (isa, t, m)


@pytest.mark.parametrize("m", [1, 3, 4, 5, 6, 7, 8])
def test_t4_the_kernel_writes_only_its_rows(m: int) -> None:
    """T4: m rows of N outputs are written and nothing else: rows after them in a larger output
    buffer keep their value."""
    k = 96
    raw = _raw("Q8_0", N, k, 51)
    seg = Segment(raw, "Q8_0", (N, k))
    tab = table([seg])
    x = _x(m, k, 52)
    with using_isa("scalar"):
        want = KQuantLinear([seg])(x)
    for isa in HERE_ISAS:
        with using_isa(isa):
            out = torch.full((m + 2, N), 7.0)
            native().kq_linear(x.data_ptr(), m, k, tab.data_ptr(), 1, out.data_ptr())
            assert same_bits(out[:m], want), (isa, m)
            assert bool((out[m:] == 7.0).all()), (isa, m)


@settings(max_examples=examples(40), deadline=None)
@given(kind=st.sampled_from(KINDS), rows=st.integers(1, 9), m=st.integers(1, 8),
       halves=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_t3_any_float16_scale_gives_the_portable_bits(kind: str, rows: int, m: int,
                                                      halves: list[int], seed: int) -> None:
    """T3: whatever the float16 d (and Q4_1's and Q5_1's m) of a few blocks (finite, zero, subnormal,
    infinite, NaN), 1..8 rows over 1..9 outputs give the portable build's bits on every ISA:
    the register kernel converts the file's scales exactly, as gguf-py does."""
    rng = np.random.default_rng(seed)
    k = 160
    per, size, scales = BLOCKS[kind]
    raw = _raw(kind, rows, k, seed).reshape(rows, k // per, size)
    for i, h in enumerate(halves):
        blk = raw[int(rng.integers(rows)), int(rng.integers(k // per))]
        off = scales[i % len(scales)]
        blk[off:off + 2] = np.array([h], np.uint16).view(np.uint8)
    lin = KQuantLinear([Segment(raw.reshape(rows, -1), kind, (rows, k))])
    x = _x(m, k, seed)
    with using_isa("scalar"):
        want = lin(x)
    for isa in HERE_ISAS:
        with using_isa(isa):
            assert same_bits(lin(x), want), isa
