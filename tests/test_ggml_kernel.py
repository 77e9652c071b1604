"""Coda's GGUF block kernel (issue 10; SPEC T4): ``GgmlLinear`` on Q4_0/Q4_1/Q8_0 blocks.

f32 mode against the float64 product with ``gguf.quants.dequantize``'s weights; q8 mode against
a NumPy model of its scheme and within its proven error bound; bitwise row invariance over the
batch size, the row's position and the thread count; the packed quant modes of a GGUF model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models import kernels
from coda.models.kernels.ggml_linear import KINDS, GgmlLinear, quantize_rows, repack
from tests.conftest import examples

if (_why := kernels.unavailable()) is not None:  # NOTE: CI sets CODA_REQUIRE_NATIVE (conftest)
    pytest.skip(f"GGUF block kernel unavailable: {_why}", allow_module_level=True)

EPS32 = 2.0**-24


def weights(kind: str, n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF bytes [n, row bytes], the float64 weights gguf dequantises them to)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    raw = quantize(w, GGMLQuantizationType[kind])
    return raw, dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64)


def acts(m: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed + 7).standard_normal((m, k)).astype(np.float32)


def run(raw: np.ndarray, kind: str, x: np.ndarray, n: int, act: str) -> np.ndarray:
    return GgmlLinear(raw, kind, n, x.shape[1], act)(torch.from_numpy(x)).numpy()


def q8_reference(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The q8 scheme in NumPy float32: per block dx = amax / 127, q = rint(x * (1 / dx))."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32)
    dx = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int8)
    return q, dx, (dx * q.astype(np.int32).sum(-1).astype(np.float32)).astype(np.float32)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 32), (3, 9, 64), (5, 37, 96), (9, 64, 256)])
def test_f32_mode_is_the_files_exact_weights_times_x(kind: str, m: int, n: int, k: int) -> None:
    """f32 mode: y = x @ W.T with W exactly gguf's dequantisation; only float32 summation
    rounding differs (bounded by K * eps * sum |x||w|). N not a multiple of the 8-row tile."""
    raw, w = weights(kind, n, k, seed=n + k)
    x = acts(m, k, seed=m)
    y = run(raw, kind, x, n, "f32")
    ref = x.astype(np.float64) @ w.T
    bound = 2 * k * EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(w).T) + 1e-30
    assert y.shape == (m, n) and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= bound)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_q8_mode_follows_its_numpy_scheme_and_error_bound(kind: str) -> None:
    """q8 mode: the activation quantisation is bit-exact with the NumPy scheme, the output
    matches that scheme's float64 value closely, and stays within its bound against the
    exact product: |y - x @ W.T| <= sum over blocks of dx / 2 * sum |w| (plus rounding)."""
    n, k, m = 45, 160, 6
    raw, w = weights(kind, n, k, seed=3)
    x = acts(m, k, seed=4)
    x[1, :32] = 0.0  # NOTE: an all-zero block (dx = 0)
    q, dx, _ = q8_reference(x)
    kq, kdx, _ = quantize_rows(torch.from_numpy(x))
    assert np.array_equal(kq.numpy().reshape(q.shape), q) and np.array_equal(kdx.numpy(), dx)
    y = run(raw, kind, x, n, "q8")
    xhat = (q.astype(np.float64) * dx[..., None].astype(np.float64)).reshape(m, k)
    scheme = xhat @ w.T
    scale = np.abs(xhat) @ np.abs(w).T
    assert np.all(np.abs(y - scheme) <= 4 * k * EPS32 * scale + 1e-30)
    wb = np.abs(w).reshape(n, k // 32, 32).sum(-1)  # [n, blocks]
    bound = (dx.astype(np.float64) / 2 * (1 + 1e-5)) @ wb.T + 4 * k * EPS32 * scale
    assert np.all(np.abs(y - x.astype(np.float64) @ w.T) <= bound)


@given(m=st.integers(1, 70), data=st.data(), kind=st.sampled_from(sorted(KINDS)),
       act=st.sampled_from(["f32", "q8"]))
def test_t4_a_rows_output_bits_do_not_depend_on_its_batch(m: int, data: st.DataObject,
                                                          kind: str, act: str) -> None:
    """T4: a row's output bits are the same alone and at any position of a batch of any size
    with any other rows (the other rows' content and scale drawn too)."""
    n, k = 27, 96
    raw, _ = weights(kind, n, k, seed=11)
    pos = data.draw(st.integers(0, m - 1), label="pos")
    seed = data.draw(st.integers(0, 2**16), label="seed")
    spread = data.draw(st.floats(1e-3, 1e3), label="spread")
    x = acts(m, k, seed) * np.float32(spread)
    row = acts(1, k, seed + 1)
    x[pos] = row[0]
    lin = GgmlLinear(raw, kind, n, k, act)
    alone = lin(torch.from_numpy(row))
    batched = lin(torch.from_numpy(x))
    assert torch.equal(batched[pos], alone[0])


@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_t4_thread_count_does_not_change_output_bits(kind: str, act: str) -> None:
    """T4: 1, 2 and 3 pool threads give bit-identical outputs (each output tile has one owner
    thread, whichever takes it)."""
    raw, _ = weights(kind, 203, 128, seed=5)
    x = torch.from_numpy(acts(13, 128, seed=6))
    lin = GgmlLinear(raw, kind, 203, 128, act)
    before = kernels.native().threads()
    try:
        outs = []
        for n in (1, 2, 3):
            kernels.set_threads(n)
            assert kernels.native().threads() == n
            outs.append(lin(x))
    finally:
        kernels.set_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_bad_shapes_kinds_and_modes_raise_clear_errors() -> None:
    raw, _ = weights("Q4_1", 8, 64, seed=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        repack(raw, "Q4_1", 8, 48)
    with pytest.raises(ValueError, match="unsupported block kind"):
        GgmlLinear(raw, "Q5_K", 8, 64)
    with pytest.raises(ValueError, match="bytes do not hold"):
        GgmlLinear(raw, "Q4_1", 9, 64)
    with pytest.raises(ValueError, match="activation mode"):
        GgmlLinear(raw, "Q4_1", 8, 64, act="bf16")
    with pytest.raises(ValueError, match="features"):
        GgmlLinear(raw, "Q4_1", 8, 64)(torch.zeros(2, 32))
    lin = GgmlLinear(raw, "Q4_1", 8, 64)
    with pytest.raises(ValueError, match="contiguous float32"):
        lin.direct()(torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous float32"):
        lin.direct()(torch.zeros(64, 2).t())
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.native().linear(0, 1, 48, 0, 0, 8, 1, False, 0)  # checked before any access
    with pytest.raises(ValueError, match="block kind"):
        kernels.native().linear(0, 1, 64, 0, 0, 8, 7, False, 0)


@pytest.mark.parametrize(("qtype", "tol"), [("Q4_1", 1e-4), ("Q8_0", 1e-4), ("Q4_0", 1e-4)])
def test_packed_modes_of_a_gguf_model_match_its_fp32_mode(tmp_path: Path, qtype: str,
                                                          tol: float) -> None:
    """gguf_packed's ``packed`` mode (every block matrix and the head through the kernel, q/k
    rows unpermuted on raw blocks) gives the fp32 mode's logits up to summation rounding;
    ``packed-q8`` (int8 activations) stays within a few percent; both are the kernel's layers."""
    from coda.models.modes import load_gguf_model
    from tests.test_gguf_tiny import PROMPT, write_gguf
    from tests.test_models import full_forward

    path = write_gguf(tmp_path / "m.gguf", "llama", name="tiny mistral", qtype=qtype)
    ref = full_forward(load_gguf_model(path, "fp32"), PROMPT)
    packed = load_gguf_model(path, "packed")
    assert isinstance(packed.logits_head, GgmlLinear)
    assert isinstance(packed.model.layers[0].self_attn.qkv_proj, GgmlLinear)
    assert (full_forward(packed, PROMPT) - ref).abs().max().item() <= tol
    model_q8 = load_gguf_model(path, "packed-q8")
    assert isinstance(model_q8.logits_head, GgmlLinear) and model_q8.logits_head.act == "q8"
    q8 = full_forward(model_q8, PROMPT)
    assert (q8 - ref).abs().max().item() <= 0.05 * ref.abs().max().item()


def test_a_missing_module_falls_back_to_q4_with_the_reason(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No built module (installed without a compiler): a typed KernelUnavailable saying so,
    which the mode table turns into ``packed`` being unavailable with the reason, and ``auto``
    serving ``q4``; never a crash, a compile or a hang (issue 18)."""
    import sys

    from coda.models import modes
    from coda.models.gguf_file import open_gguf
    from tests.test_gguf_tiny import write_gguf
    from tests.test_quant_modes import PAD

    monkeypatch.setitem(sys.modules, "coda._native", None)  # NOTE: import raises ImportError
    with pytest.raises(kernels.KernelUnavailable, match="not built"):
        kernels.native.__wrapped__()
    monkeypatch.setattr(kernels, "unavailable", lambda: "coda._native is not built")
    assert "not built" in (modes.QUANT_MODES["packed-q8"].available() or "")
    said = modes.QUANT_MODES["fp32"].summary()["native_kernels"]
    assert isinstance(said, str) and said.startswith("unavailable: coda._native is not built")
    assert "q4 or fp32" in said
    ckpt = open_gguf(write_gguf(tmp_path / "m.gguf", "llama", qtype="Q4_1",
                                extra_tokens=PAD))
    assert modes.resolve_mode("auto", None, ckpt).name == "q4"


def _layout_oracle(raw: np.ndarray, kind: str, n: int, k: int,
                   act: str) -> tuple[np.ndarray, np.ndarray]:
    """repack's layout written out row by row from csrc/blocks.h's description: per (tile,
    block) the 8 rows' d (then Q4_1's m), zero for padding rows; Q4 quants row after row (q8
    mode) or in the dword layout (f32 mode: group g's byte 4 l + j is row 4 g + j's byte l),
    Q8_0 rows 2p and 2p + 1 interleaved by 16-byte halves."""
    size, qb = KINDS[kind]
    fields, nb, tiles = size - qb, k // 32, -(-n // 8)
    blocks = raw.reshape(n, nb, size)
    sc = np.zeros((tiles, nb, fields // 2, 8), np.float16)
    q = np.zeros((tiles, nb, 8, qb), np.uint8)
    for r in range(n):
        t, i = divmod(r, 8)
        for b in range(nb):
            sc[t, b, :, i] = blocks[r, b, :fields].view(np.float16)
            quants = blocks[r, b, fields:]
            if kind == "Q8_0":
                pair = q[t, b, i & ~1:(i & ~1) + 2].reshape(-1)  # [c0..15|c1 0..15|c0 16..|c1 16..]
                pair[(i & 1) * 16:(i & 1) * 16 + 16] = quants[:16]
                pair[32 + (i & 1) * 16:32 + (i & 1) * 16 + 16] = quants[16:]
                q[t, b, i & ~1:(i & ~1) + 2] = pair.reshape(2, 32)
            elif act == "q8":
                q[t, b, i] = quants
            else:
                group = q[t, b].reshape(-1)[(i // 4) * 64:(i // 4) * 64 + 64]
                for lb in range(16):
                    group[4 * lb + i % 4] = quants[lb]
    return sc.reshape(tiles, nb, -1), q


@given(data=st.data())
@settings(deadline=None, max_examples=examples(60))
def test_repack_of_a_fused_projections_parts_is_the_row_by_row_layout(data: st.DataObject) -> None:
    """Issue 19 item 2: repack takes a fused projection's parts (as the packed loader passes
    them, straight from the mapped file) and writes the kernel's layout (T4's tiles) exactly
    as the row-by-row oracle does, parts of any row counts (ragged, not tile-aligned) included;
    the same bytes as repacking their concatenation; in each activation mode's layout."""
    kind = data.draw(st.sampled_from(sorted(KINDS)), label="kind")
    act = data.draw(st.sampled_from(["f32", "q8"]), label="act")
    k = 32 * data.draw(st.integers(1, 4), label="blocks")
    rows = data.draw(st.lists(st.integers(1, 20), min_size=1, max_size=4), label="rows")
    size = KINDS[kind][0]
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    parts = [rng.integers(0, 256, (r, k // 32 * size), dtype=np.uint8) for r in rows]
    whole = np.concatenate(parts)
    sc_o, q_o = _layout_oracle(whole, kind, len(whole), k, act)
    for given_raw in (parts, whole):
        sc, q = repack(given_raw, kind, len(whole), k, act)
        assert np.array_equal(sc.numpy().view(np.uint16), sc_o.view(np.uint16))
        assert np.array_equal(q.numpy(), q_o)
