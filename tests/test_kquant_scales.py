"""The K-quant sub-scale unpack of the register kernels (kquant_decode.h; issue 18; SPEC T3, T4).

The AVX2 and AVX-512 builds unpack a super-block's packed sub-scales (Q4_K/Q5_K: 8 six-bit
scales and 8 six-bit mins in 12 bytes; Q3_K: 16 six-bit signed scales in 12; Q6_K: 16 int8;
Q2_K: 16 nibble pairs) with vector shuffles and masks, all of a block at once. Random bytes
exercise every bit together; here each scale bit is set alone, so a bit routed to the wrong
sub-block, shifted by one or masked off shows in one row, against ``gguf.quants.dequantize``
(one-hot inputs read single weights out of the register kernel exactly) and against the
portable build's bits at 1 and 8 input rows (the one-row kernel and the 8-row tile).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from coda.models.kernels import unavailable
from tests.conftest import kernel_isas, using_isa
from tests.kquant_files import BLOCKS

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.kquant_linear import KQuantLinear, Segment  # noqa: E402

HERE_ISAS = kernel_isas()
# byte range of the packed sub-scales in a super-block, per type
SCALE_BYTES = {"Q4_K": (4, 16), "Q5_K": (4, 16), "Q3_K": (96, 108), "Q6_K": (192, 208),
               "Q2_K": (0, 16)}
# float16 bits of d and dmin: 0.5 and -0.25 (a negative dmin: its sign must reach the mins)
HALVES = (0x3800, 0xB400)


def one_bit_blocks(qtype: str, rng: np.random.Generator) -> np.ndarray:
    """One super-block per scale bit (that bit alone set in the packed sub-scales; random codes),
    then one with every scale bit set: raw rows [bits + 1, block bytes] of K = 256."""
    _, size, scales = BLOCKS[qtype]
    lo, hi = SCALE_BYTES[qtype]
    nbits = 8 * (hi - lo)
    raw = rng.integers(0, 256, size=(nbits + 1, size), dtype=np.uint8)
    raw[:, lo:hi] = 0
    for i in range(nbits):
        raw[i, lo + i // 8] = 1 << (i % 8)
    raw[nbits, lo:hi] = 0xFF
    for off, h in zip(scales, HALVES, strict=False):
        raw[:, off:off + 2] = np.array([h], np.uint16).view(np.uint8)
    return raw


@pytest.mark.parametrize("isa", HERE_ISAS)
@pytest.mark.parametrize("qtype", sorted(SCALE_BYTES))
def test_t3_each_scale_bit_reaches_its_own_weights_in_the_register_kernel(qtype: str,
                                                                          isa: str) -> None:
    """T3: with one-hot inputs (one row each: the register kernel) every output is exactly the
    dequantized weight, for blocks that set each packed scale bit alone."""
    raw = one_bit_blocks(qtype, np.random.default_rng(7))
    n = raw.shape[0]
    w = dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, 256).astype(np.float32)
    lin = KQuantLinear([Segment(raw.reshape(n, -1), qtype, (n, 256))])
    with using_isa(isa):
        for k in range(0, 256, 5):
            x = torch.zeros(1, 256)
            x[0, k] = 1.0
            # NOTE: == (not bits): w * 1 summed with +0.0 gives +0.0 for a -0.0 weight
            assert np.array_equal(lin(x).numpy()[0], w[:, k]), k


@pytest.mark.parametrize("isa", [i for i in HERE_ISAS if i != "scalar"])
@pytest.mark.parametrize("qtype", sorted(SCALE_BYTES))
def test_t4_each_scale_bit_gives_the_portable_bits_at_one_and_eight_rows(qtype: str,
                                                                         isa: str) -> None:
    """T4: random inputs over the one-bit blocks: 1 row (the one-row kernel) and 8 rows
    (AVX-512's 8-row tile) give the scalar build's bits."""
    raw = one_bit_blocks(qtype, np.random.default_rng(8))
    n = raw.shape[0]
    lin = KQuantLinear([Segment(raw.reshape(n, -1), qtype, (n, 256))])
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(9))
    with using_isa("scalar"):
        want = lin(x).numpy()
    with using_isa(isa):
        for m in (1, 8):
            got = lin(x[:m]).numpy()
            assert np.array_equal(got.view(np.uint32), want[:m].view(np.uint32)), m
