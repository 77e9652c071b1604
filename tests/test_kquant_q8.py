"""``packed-q8`` on K-quants: Q8_K activations and exact integer dots (issue 18 item 1; SPEC T3,
T4). ``csrc/kquants_q8.h``.

* the kernel against a numpy reference built from ggml's definitions (Q8_K quantization of
  each row as ``quantize_row_q8_K_ref``; the weights as ``gguf.quants.dequantize``): the
  integer sums are exact, so the only error is float32 rounding of a few block terms;
* every ISA build gives the scalar build's bits (the integer parts are exact, the float steps
  one fixed order), with a row map, a bias and a fused Q4_K + Q6_K projection;
* a row's bits do not depend on its batch (T4), whatever grouping of outputs and rows the SIMD
  path (``csrc/kquants_q8_simd.h``, ``kquants_q8_blk.h``, ``kquants_q8_row.h``) takes (short groups, segment mixes, thread counts);
* a Q4_K_M-like model in ``packed-q8`` runs the K-quants on Q8_K (the load summary says so)
  and stays near ``packed``'s logits (8-bit activations: lossy, as llama.cpp's CPU path).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.kernels import native, unavailable
from tests.conftest import examples, kernel_isas, using_isa
from tests.kquant_files import q4_k_m, random_blocks, write_mixed

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.kquant_linear import Q8K_TYPES, KQuantLinear, Segment  # noqa: E402


def q8k(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q8_K_ref then its dequantization, per 256 (float32 arithmetic):
    the activations the integer kernel multiplies, exactly."""
    out = np.zeros_like(x)
    for r, row in enumerate(x):
        for b in range(0, row.size, 256):
            blk = row[b:b + 256]
            at = int(np.argmax(np.abs(blk)))  # NOTE: the first of equal magnitudes
            if blk[at] == 0:
                continue
            iscale = np.float32(-127.0) / blk[at]
            q = np.minimum(np.rint(iscale * blk), 127).astype(np.float32)
            out[r, b:b + 256] = q * (np.float32(1.0) / iscale)
    return out


def _weights(qtype: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    raw = random_blocks(qtype, n, k, np.random.default_rng(seed))
    w = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float64)
    return raw, w


@pytest.mark.parametrize("qtype", Q8K_TYPES)
def test_t3_q8k_dot_equals_the_integer_reference(qtype: str) -> None:
    """T3: for random blocks of each K-quant type, the q8 kernel gives W (the file's weights
    exactly) times Q8_K(x) (ggml's activation quantization) up to float32 rounding of the
    per-block terms: bounded by 1e-5 of sum |w| |x| per output."""
    n, k, m = 19, 768, 3
    raw, w = _weights(qtype, n, k, seed=11)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(4)) * 2
    x[1, :256] = 0.0  # NOTE: an all-zero block (d = 0)
    got = KQuantLinear([Segment(raw, qtype, (n, k))], act="q8")(x).numpy().astype(np.float64)
    xq = q8k(x.numpy()).astype(np.float64)
    want = xq @ w.T
    bound = np.abs(xq) @ np.abs(w).T
    assert np.all(np.abs(got - want) <= 1e-5 * bound + 1e-30), np.max(np.abs(got - want) / bound)
    # NOTE: and q8 really quantizes: float32 activations give another result
    exact = x.numpy().astype(np.float64) @ w.T
    assert np.max(np.abs(exact - want)) > 1e-4 * np.max(bound)


def test_t4_q8k_bits_are_the_same_on_every_isa_and_in_any_batch() -> None:
    """T4: a fused Q4_K + Q6_K projection with a row map and a bias in q8 mode: every ISA gives
    the scalar build's bits, and each row's bits are its bits alone."""
    rng = np.random.default_rng(3)
    k = 512
    a, _ = _weights("Q4_K", 21, k, seed=1)
    b, _ = _weights("Q6_K", 10, k, seed=2)
    order = rng.permutation(21)
    bias = torch.from_numpy(rng.standard_normal(10).astype(np.float32))
    lin = KQuantLinear([Segment(a, "Q4_K", (21, k), order), Segment(b, "Q6_K", (10, k), None,
                                                                   bias)], act="q8")
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(5))
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        with using_isa(isa):
            got = lin(x)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), isa
            for r in (0, 4, 8):
                assert torch.equal(lin(x[r:r + 1].clone())[0], got[r]), (isa, r)


@pytest.mark.parametrize("qtype", Q8K_TYPES)
def test_t4_each_k_quant_type_has_the_scalar_bits_on_every_isa(qtype: str) -> None:
    """T4: each type's q8 product (portable code unpack in the scalar build, SIMD unpack and
    integer dots in the others) is the scalar build's, bit for bit."""
    raw, _ = _weights(qtype, 13, 512, seed=7)
    lin = KQuantLinear([Segment(raw, qtype, (13, 512))], act="q8")
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(8)) * 3
    with using_isa("scalar"):
        want = lin(x)
    for isa in kernel_isas():
        with using_isa(isa):
            assert torch.equal(lin(x).view(torch.int32), want.view(torch.int32)), isa


@settings(max_examples=examples(12), deadline=None)
@given(parts=st.lists(st.tuples(st.sampled_from(Q8K_TYPES), st.integers(1, 9), st.booleans(),
                                st.booleans()), min_size=1, max_size=4),
       m=st.integers(1, 9), threads=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_t4_q8k_groups_and_row_quads_keep_the_scalar_bits(
        parts: list[tuple[str, int, bool, bool]], m: int, threads: int, seed: int) -> None:
    """T4: the SIMD builds group four (output, row) pairs per reduction (``kquants_q8_simd.h``:
    four outputs of one segment at M = 1, four activation rows of one output at M >= 2). For any
    segments (types, row counts that leave a short last group, row maps, biases), any M (short
    last quad) and any thread count (ranges cut anywhere), every output has the scalar build's
    bits, and each row alone gives its bits in the batch."""
    rng = np.random.default_rng(seed)
    k = 512
    segs = []
    for qtype, rows, mapped, biased in parts:
        raw = random_blocks(qtype, rows, k, rng)
        bias = torch.from_numpy(rng.standard_normal(rows).astype(np.float32)) if biased else None
        segs.append(Segment(raw, qtype, (rows, k), rng.permutation(rows) if mapped else None,
                            bias))
    lin = KQuantLinear(segs, act="q8")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    with using_isa("scalar"):
        want = lin(x)
    before = native().threads()
    try:
        native().set_threads(threads)
        for isa in kernel_isas():
            with using_isa(isa):
                got = lin(x)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (isa, m)
                r = m - 1
                assert torch.equal(lin(x[r:r + 1].clone())[0].view(torch.int32),
                                   want[r].view(torch.int32)), (isa, r)
    finally:
        native().set_threads(before)


def test_q8_needs_k_quant_tensors() -> None:
    """q8 activations on a type without a Q8_K kernel are refused with the reason."""
    raw, _ = _weights("Q5_0", 4, 256, seed=1)
    with pytest.raises(ValueError, match="K-quant"):
        KQuantLinear([Segment(raw, "Q5_0", (4, 256))], act="q8")


def test_t3_a_q4_k_m_model_in_packed_q8_runs_q8k(tmp_path: Path) -> None:
    """T3: a Q4_K_M-like file in ``packed-q8``: the summary names the Q8_K kernel for Q4_K and
    Q6_K; the logits stay near ``packed``'s (8-bit activations) but are not its bits."""
    from coda.models.gguf_file import open_gguf
    from coda.models.modes import load_gguf_model
    from tests.test_models import full_forward

    ckpt = open_gguf(write_mixed(tmp_path / "m.gguf", q4_k_m))
    q8 = load_gguf_model(ckpt, "packed-q8")
    assert q8.kernels["Q4_K"].startswith("packed-q8k/")
    assert q8.kernels["Q6_K"].startswith("packed-q8k/")
    ids = [5, 17, 40, 2, 88, 93, 61, 3, 70]
    ref = full_forward(load_gguf_model(ckpt, "packed"), ids)
    got = full_forward(q8, ids)
    scale = ref.abs().max().item()
    assert 0 < (got - ref).abs().max().item() <= 0.05 * scale
