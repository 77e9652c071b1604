"""``packed-q8`` K-quants at one activation row on the AVX-512 build (issue 18, branch kq8b1;
SPEC T3, T4): ``csrc/kquants_q8_row512.h`` (Q4_K / Q5_K / Q6_K, 64 weights per instruction,
the row copied once per call into the order the Q4_K / Q5_K nibbles come out, four blocks'
scales, mins and sums reduced together).

* blocks at the extremes of every field (largest codes, scales and mins, Q6_K's -128 and 127
  sub-scales) against activation rows whose codes are all +-127: the integer sums are the
  scalar build's (no int16 saturation, no lost bit), so the bits are;
* one row over 1..9 super-blocks (a short last group of four, the masked loads) against the
  numpy reference of ggml's definitions, on every ISA.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from coda.models.kernels import unavailable
from tests.conftest import kernel_isas, using_isa
from tests.kquant_files import random_blocks

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.kquant_linear import KQuantLinear, Segment  # noqa: E402
from tests.test_kquant_q8 import q8k  # noqa: E402

BLOCK = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _extreme_rows(qtype: str, blocks: int) -> np.ndarray:
    """Six rows of blocks: every field at its largest, codes at 0, alternating bytes, random
    codes under the largest scales, and (Q6_K) sub-scales of -128 and 127."""
    rng = np.random.default_rng(3)
    bb = BLOCK[qtype]
    raw = np.zeros((6, blocks, bb), np.uint8)
    raw[0] = 0xFF
    raw[2] = np.tile(np.array([0x0F, 0xF0], np.uint8), bb // 2)
    raw[3:] = rng.integers(0, 256, size=(3, blocks, bb), dtype=np.uint8)
    one = np.array([1.0], np.float16).view(np.uint8)
    half = np.array([0.5], np.float16).view(np.uint8)
    if qtype in ("Q4_K", "Q5_K"):
        raw[:, :, 4:16] = 0xFF  # NOTE: every scale and min 63
        raw[1, :, 16:] = 0
        raw[:, :, 0:2], raw[:, :, 2:4] = one, half
    else:
        raw[1, :, :192] = 0
        raw[:, :, 192:208] = 0x80  # NOTE: every sub-scale -128
        raw[4, :, 192:208] = np.tile(np.array([0x80, 0x7F], np.uint8), 8)
        raw[:, :, 208:210] = one
    return raw.reshape(6, blocks * bb)


@pytest.mark.parametrize("qtype", list(BLOCK))
def test_t4_one_row_extreme_blocks_have_the_scalar_bits(qtype: str) -> None:
    """T4: extreme blocks x activation rows of all +127 / all -127 / alternating codes, one row
    per call (the M = 1 kernel), 5 super-blocks (a group of four and a short one): every ISA
    gives the scalar build's bits."""
    blocks = 5
    k = 256 * blocks
    lin = KQuantLinear([Segment(_extreme_rows(qtype, blocks), qtype, (6, k))], act="q8")
    xs = [torch.ones(1, k), -torch.ones(1, k),
          torch.tensor([[1.0, -1.0] * (k // 2)]), torch.tensor([[-1.0, 1.0] * (k // 2)])]
    for x in xs:
        with using_isa("scalar"):
            want = lin(x)
        for isa in kernel_isas():
            with using_isa(isa):
                assert torch.equal(lin(x).view(torch.int32), want.view(torch.int32)), isa


@pytest.mark.parametrize("qtype", list(BLOCK))
@pytest.mark.parametrize("blocks", range(1, 10))
def test_t3_one_row_equals_the_integer_reference(qtype: str, blocks: int) -> None:
    """T3: one row over 1..9 super-blocks (every length of the last group of four) equals
    sum(dequantized weight x Q8_K activation) within float32 rounding of its block terms, on
    every ISA."""
    k, n = 256 * blocks, 11
    rng = np.random.default_rng(blocks)
    raw = random_blocks(qtype, n, k, rng)
    w = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k).astype(np.float64)
    lin = KQuantLinear([Segment(raw, qtype, (n, k))], act="q8")
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(blocks)) * 2
    want = q8k(x.numpy()).astype(np.float64) @ w.T
    scale = np.abs(q8k(x.numpy())).astype(np.float64) @ np.abs(w).T
    for isa in kernel_isas():
        with using_isa(isa):
            got = lin(x).numpy().astype(np.float64)
            assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-30), isa
