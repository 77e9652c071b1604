"""The native row ops (``coda/models/kernels/csrc/rows.h``; issues 10, 18, SPEC T3, T4), at
SmolLM2-135M's head shape (9 query heads, 3 KV heads, d_h 64):

* T4 (property, brute-force oracle): under random batching, chunking and paging, every row of
  the fused RoPE + cache write + attention call equals, bit for bit, the same row decoded alone;
* the kernel computes what the torch path computes: RoPE with the same bits (the cached keys are
  equal), attention to float32 rounding, RMSNorm / residual-add / SiLU-gate to rounding;
* the runner picks the native path where it can, refuses it where it cannot, and a model's
  logits through it match the torch path's; bad block ids are a typed error, not a crash."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models import kernels
from coda.models.attention import AttentionMetadata, attend_native, paged_attention
from coda.models.llama import apply_rope
from tests.attention_support import schedule_rows
from tests.conftest import examples

if (_why := kernels.unavailable()) is not None:  # NOTE: CI sets CODA_REQUIRE_NATIVE (conftest)
    pytest.skip(f"native row ops unavailable: {_why}", allow_module_level=True)

from coda.models.kernels import ops as EXT  # noqa: E402

H, H_KV, D = 9, 3, 64
W = (H + 2 * H_KV) * D


def _rope_table(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [n, D] (llama.py's layout) at rope_theta 10 000."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    f = torch.arange(n, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat((f, f), dim=-1)
    sin = emb.sin()
    return emb.cos(), torch.cat((-sin[:, : D // 2], sin[:, D // 2:]), dim=-1)


COS, SIN = _rope_table(512)


def _qkv(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, W, generator=torch.Generator().manual_seed(seed))


def _cache(num_blocks: int, bs: int) -> torch.Tensor:
    return torch.zeros(2, H_KV, num_blocks, bs, D)


def _native(qkv: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    pos = meta.positions
    return attend_native(qkv, COS[pos].contiguous(), SIN[pos].contiguous(), kv, meta, H, H_KV)


def _alone(qkv: torch.Tensor, bs: int) -> torch.Tensor:
    """Oracle: every row of one sequence, each computed by a decode step of batch 1."""
    n = qkv.shape[0]
    kv = _cache(-(-n // bs), bs)
    table = list(range(-(-n // bs)))
    rows = []
    for p in range(n):
        meta = AttentionMetadata.build([1], [p + 1], [table], bs, kernel=True)
        rows.append(_native(qkv[p:p + 1], kv, meta)[0])
    return torch.stack(rows)


def _schedule(lengths: list[int], bs: int, rng: random.Random,
              seeds: list[int]) -> list[torch.Tensor]:
    """All sequences together (tests/attention_support.py) through the native kernel."""
    data = [(_qkv(n, s),) for n, s in zip(lengths, seeds, strict=True)]
    return schedule_rows(lengths, bs, rng, data, _cache(sum(-(-n // bs) for n in lengths), bs),
                         lambda x, kv, meta: _native(x[0], kv, meta), kernel=True)


@settings(max_examples=examples(6), deadline=None)
@given(seed=st.integers(0, 2**16), bs=st.sampled_from([1, 4, 16]),
       lengths=st.lists(st.integers(1, 150), min_size=1, max_size=4))
def test_t4_native_rows_equal_the_row_alone(seed: int, bs: int, lengths: list[int]) -> None:
    """T4 (property, brute-force oracle): every row of the native call, under random batching,
    chunking and paging, equals bit for bit the same row decoded alone in a batch of one."""
    rng = random.Random(seed)
    seeds = [rng.randrange(1 << 30) for _ in lengths]
    got = _schedule(lengths, bs, rng, seeds)
    for n, s, rows in zip(lengths, seeds, got, strict=True):
        assert torch.equal(rows, _alone(_qkv(n, s), bs))


def test_native_matches_the_torch_path_t3() -> None:
    """The same 90-token sequence (prefill 70, one decode, prefill 19): the keys the kernel
    caches are the torch path's RoPE'd keys bit for bit, the values are stored as given, and
    the attention rows agree to float32 rounding."""
    qkv = _qkv(90, 5)
    outs, caches = [], []
    for kernel in (True, False):
        kv = _cache(8, 16)
        rows = []
        for start, n in ((0, 70), (70, 1), (71, 19)):
            meta = AttentionMetadata.build([n], [start + n], [list(range(8))], 16, kernel=kernel)
            x = qkv[start:start + n]
            if kernel:
                rows.append(_native(x, kv, meta))
                continue
            pos = meta.positions
            qk = apply_rope(x[:, : (H + H_KV) * D].view(n, H + H_KV, D), COS[pos][:, None],
                            SIN[pos][:, None])
            rows.append(paged_attention(qk[:, :H], qk[:, H:], x[:, (H + H_KV) * D:].view(
                n, H_KV, D), kv, meta))
        outs.append(torch.cat(rows))
        caches.append(kv)
    assert torch.equal(caches[0], caches[1])
    assert (outs[0] - outs[1]).abs().max() < 2e-5


def test_rms_norm_add_and_silu_gate_match_torch_and_are_row_local() -> None:
    """rms_norm / add_rms_norm / silu_mul agree with the torch formulas to rounding, and a row
    computed inside a batch of 37 has the bits it has alone."""
    g = torch.Generator().manual_seed(3)
    x, r = torch.randn(37, 576, generator=g), torch.randn(37, 576, generator=g)
    w = torch.rand(576, generator=g) + 0.5
    ref = torch.nn.functional.rms_norm(x, (576,), w, 1e-5)
    assert torch.allclose(EXT.rms_norm(x, w, 1e-5), ref, rtol=1e-5, atol=1e-5)
    h = x.clone()
    normed = EXT.add_rms_norm(h, r, w, 1e-5)
    assert torch.equal(h, x + r)  # the residual is updated in place
    assert torch.allclose(normed, torch.nn.functional.rms_norm(x + r, (576,), w, 1e-5),
                          rtol=1e-5, atol=1e-5)
    gu = torch.randn(37, 2 * 1536, generator=g) * 6
    act = EXT.silu_mul(gu)
    want = torch.nn.functional.silu(gu[:, :1536]) * gu[:, 1536:]
    assert torch.allclose(act, want, rtol=2e-6, atol=1e-6)
    for i in (0, 17, 36):
        assert torch.equal(EXT.rms_norm(x[i:i + 1].clone(), w, 1e-5)[0],
                           EXT.rms_norm(x, w, 1e-5)[i])
        assert torch.equal(EXT.silu_mul(gu[i:i + 1].clone())[0], act[i])


def test_bad_block_id_is_a_typed_error() -> None:
    """A block id past the cache raises (IndexError from the module's checks, before any
    kernel runs), no crash; so does a slot past the cache."""
    kv = _cache(2, 16)
    meta = AttentionMetadata.build([1], [1], [[5]], 16, kernel=True)
    with pytest.raises(IndexError, match="out of range"):
        _native(_qkv(1, 1), kv, meta)
    meta = AttentionMetadata.build([1], [1], [[1]], 16, kernel=True)
    meta.slot_mapping.fill_(99)
    with pytest.raises(IndexError, match="slot out of range"):
        _native(_qkv(1, 1), kv, meta)


def test_runner_picks_native_where_it_can_and_logits_match(server_checkpoint: object) -> None:
    """ModelRunner(auto) runs the native path on a float32 cache and says so; forcing it on a
    bfloat16 cache is a ValueError with the reason; the two paths' logits agree."""
    from coda.engine.runner import ModelRunner, SeqChunk
    from coda.models.loader import load_model

    model = load_model(server_checkpoint)  # type: ignore[arg-type]
    fast = ModelRunner(model, num_blocks=16)
    slow = ModelRunner(model, num_blocks=16, native_attention=False)
    assert fast.native_attention and fast.attention_note == "native row kernel"
    assert not slow.native_attention
    with pytest.raises(ValueError, match="bfloat16"):
        ModelRunner(model, num_blocks=16, dtype="bfloat16", native_attention=True)
    chunks = [SeqChunk(tuple(range(3, 40)), 0, (0, 1, 2), True),
              SeqChunk((7, 8, 9), 0, (3,), True)]
    a, b = fast.execute(chunks), slow.execute(chunks)
    assert (a - b).abs().max() < 1e-4 and torch.equal(a.argmax(-1), b.argmax(-1))


def test_t4_thread_count_does_not_change_native_bits() -> None:
    """T4: 1, 2 and 3 pool threads give the same bits (each (row, KV head) and each row has
    one owner thread, whichever takes it)."""
    qkv = _qkv(70, 9)
    before = kernels.native().threads()
    outs = []
    try:
        for threads in (1, 2, 3):
            kernels.set_threads(threads)
            kv = _cache(8, 16)
            meta = AttentionMetadata.build([60, 10], [60, 10], [list(range(4)), [4]], 16,
                                           kernel=True)
            outs.append((_native(qkv, kv, meta), EXT.rms_norm(qkv, torch.ones(W), 1e-6),
                         EXT.silu_mul(qkv[:, :W - W % 16].contiguous())))
    finally:
        kernels.set_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other, strict=True))


def test_kernels_release_the_gil_while_they_run() -> None:
    """A long native call leaves the GIL to other threads (the server's event loop keeps
    serving during a forward step): a Python thread ticking meanwhile never waits anywhere
    near the call's length."""
    import threading
    import time

    x, w = torch.randn(8000, 4096), torch.rand(4096)
    EXT.rms_norm(x, w, 1e-6)
    done, ticks = threading.Event(), []
    took: list[float] = []

    def work() -> None:
        t0 = time.perf_counter()
        for _ in range(3):
            EXT.rms_norm(x, w, 1e-6)
        took.append((time.perf_counter() - t0) / 3)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    while not done.is_set():
        ticks.append(time.perf_counter())
        time.sleep(0.0005)
    worker.join()
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert took[0] > 0.01 and max(gaps) < took[0] * 0.6, (max(gaps), took[0])
