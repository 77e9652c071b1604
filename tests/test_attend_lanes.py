"""The SIMD builds' attention lanes (issue 21; SPEC T4): ``csrc/rows_attend512.h`` (AVX-512) and
``csrc/rows_attend256.h`` (AVX2) run the query heads of one KV head over several consecutive rows
of one sequence side by side (a verification's 1 + k rows, a prefill chunk's), each lane masked
to its own keys. A row's output must not depend on that: the multi-row call gives, bit for bit,
the same rows as the rows attended one at a time (each a call of its own, as a plain decode step
runs them) and as the scalar build's multi-row call, at every head size, query heads per KV head
(1 to 16 lanes a row), row count (1 to 9: one or two items), context (any block remainder) and
sliding window, with scores near and far (exp deep in underflow), and with non-finite inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models import kernels
from tests.conftest import examples, kernel_isas, using_isa

if (_why := kernels.unavailable()) is not None:  # NOTE: CI sets CODA_REQUIRE_NATIVE (conftest)
    pytest.skip(f"native kernels unavailable: {_why}", allow_module_level=True)

from coda.models.attention import AttentionMetadata  # noqa: E402
from coda.models.kernels import ops  # noqa: E402

SIMD = [pytest.param(name, marks=pytest.mark.skipif(name not in kernel_isas(),
                                                      reason=f"this CPU cannot run {name}"))
        for name in ("avx2", "avx512")]


class Case:
    """Sequence A verifies ``m`` rows after ``ctx`` cached keys; optionally a decode row of
    sequence B (``other``: 0 none, 1 before A's rows in the call, 2 after)."""

    def __init__(self, seed: int, d: int, group: int, hkv: int, bs: int, ctx: int, m: int,
                 window: int, scale: float, other: int) -> None:
        self.d, self.h, self.hkv, self.bs, self.window = d, hkv * group, hkv, bs, window
        g = torch.Generator().manual_seed(seed)
        blocks_a = -(-(ctx + m) // bs)
        perm = torch.randperm(blocks_a + 3, generator=g).tolist()
        self.seqs = [(ctx + m, m, perm[:blocks_a])]  # NOTE: (length, new rows, block table)
        if other:
            b = (5, 1, perm[blocks_a:])
            self.seqs = [b, *self.seqs] if other == 1 else [*self.seqs, b]
        self.qkv = torch.randn(sum(s[1] for s in self.seqs), (self.h + 2 * hkv) * d,
                               generator=g) * scale
        self.cache = torch.randn(2, hkv, blocks_a + 3, bs, d, generator=g) * scale

    def poison(self) -> None:
        """Non-finite inputs: an infinite query element, a NaN and an infinite key element."""
        self.qkv[-1, 3] = float("inf")
        self.cache[0, 0, self.seqs[-1][2][0], 0, 1] = float("nan")
        self.cache[0, -1, self.seqs[0][2][-1], -1, 0] = float("-inf")

    def _call(self, qkv: torch.Tensor, seqs: list[tuple[int, int, list[int]]],
              kv: torch.Tensor) -> torch.Tensor:
        meta = AttentionMetadata.build([s[1] for s in seqs], [s[0] for s in seqs],
                                       [s[2] for s in seqs], self.bs, kernel=True)
        assert meta.rows is not None
        pos = meta.positions
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.d, 2, dtype=torch.float32) / self.d))
        f = pos.float()[:, None] * inv[None, :]
        emb = torch.cat((f, f), dim=-1)
        half = self.d // 2
        cos, sin = emb.cos(), torch.cat((-emb.sin()[:, :half], emb.sin()[:, half:]), dim=-1)
        return ops.attend(qkv, cos.contiguous(), sin, kv, meta.slot_mapping, meta.rows.seq_of,
                          pos, meta.rows.tables, self.h, self.hkv, window=self.window)

    def together(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row in one call: the output rows and the cache after it."""
        kv = self.cache.clone()
        return self._call(self.qkv, self.seqs, kv), kv

    def alone(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row in a call of its own, in the same order."""
        kv, outs, t = self.cache.clone(), [], 0
        for length, new, table in self.seqs:
            for r in range(new):
                seq = [(length - new + r + 1, 1, table)]
                outs.append(self._call(self.qkv[t:t + 1], seq, kv))
                t += 1
        return torch.cat(outs), kv


def _same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))


def _check(isa: str, case: Case) -> None:
    with using_isa("scalar"):
        ref = case.together()
    with using_isa(isa):
        got, alone = case.together(), case.alone()
    _same_bits(got, ref)
    _same_bits(got, alone)


@pytest.mark.parametrize("isa", SIMD)
@settings(max_examples=examples(60), deadline=None)
@given(seed=st.integers(0, 2**16), d=st.sampled_from([32, 64, 96, 128, 256]),
       group=st.sampled_from([1, 2, 3, 4, 5, 8, 16]), hkv=st.integers(1, 2),
       bs=st.sampled_from([4, 16]), ctx=st.integers(0, 150), m=st.integers(1, 9),
       window=st.sampled_from([0, 0, 1, 2, 5, 40]), scale=st.sampled_from([1.0, 12.0]),
       other=st.integers(0, 2))
def test_t4_multi_row_attention_equals_rows_alone_and_scalar(
        isa: str, seed: int, d: int, group: int, hkv: int, bs: int, ctx: int, m: int,
        window: int, scale: float, other: int) -> None:
    """T4 (property, issue 21): a sequence's 1..9 rows attended in one call (lanes side by
    side, masked per key) equal the rows attended one call each and the scalar build's call,
    bit for bit, outputs and cache, for every head size, GQA ratio, context and window."""
    _check(isa, Case(seed, d, group, hkv, bs, ctx, m, window, scale, other))


@pytest.mark.parametrize("isa", SIMD)
@pytest.mark.parametrize(("d", "group", "m"), [(64, 3, 9), (64, 3, 5), (128, 4, 4), (32, 1, 9),
                                               (256, 16, 2), (96, 5, 3)])
def test_t4_multi_row_attention_edges(isa: str, d: int, group: int, m: int) -> None:
    """T4 (issue 21): fixed edges of the lanes: one or two 8-lane halves full and part-full,
    contexts one short of, at, and one past a block, a window of one key (each row its own key
    only) and of two, and non-finite inputs (an infinite query element, NaN and -inf keys:
    the NaNs' bits as the scalar build's)."""
    for ctx in (15, 16, 17):
        for window in (0, 1, 2):
            _check(isa, Case(ctx, d, group, 1, 16, ctx, m, window, 1.0, 0))
    poisoned = Case(7, d, group, 2, 4, 30, m, 0, 1.0, 2)
    poisoned.poison()
    _check(isa, poisoned)

