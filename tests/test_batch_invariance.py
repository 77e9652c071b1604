"""T4 bit-for-bit: a sequence's logits never depend on its batch, its chunking, its block table
or on whether its tokens were prefilled or decoded — in the exact fp32 mode, in the packed
int4 mode and with Coda's GGUF block kernel in both activation modes (issue 10). Equality is
``torch.equal``, not a tolerance."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.runner import ModelRunner, SeqChunk
from coda.models.llama import CausalLM
from coda.models.loader import load_model
from coda.models.quant import Int4Linear, Int8Linear, Q8Split, dequantize
from tests.random_checkpoint import make_random_checkpoint
from tests.test_runner import run_schedule

VOCAB = 320


def _ggml_like(weight: torch.Tensor, kind: str, act: str) -> torch.nn.Module:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from coda.models.kernels import unavailable
    from coda.models.kernels.ggml_linear import GgmlLinear

    if (why := unavailable()) is not None:
        pytest.skip(f"GGUF block kernel unavailable: {why}")
    w = weight.detach().float().numpy()
    return GgmlLinear(quantize(w, GGMLQuantizationType[kind]), kind, w.shape[0], w.shape[1], act)


def _int4_like(linear: torch.nn.Linear, rng: np.random.Generator) -> Int4Linear:
    n, k = linear.weight.shape
    codes = rng.integers(0, 16, size=(n, k), dtype=np.int32)
    scale = rng.uniform(0.001, 0.02, size=(n, k // 32)).astype(np.float32)
    zero = rng.uniform(-0.05, 0.05, size=(n, k // 32)).astype(np.float32)
    return Int4Linear(codes, scale, zero)


@pytest.fixture(scope="module", params=["int4", "packed", "packed-q8"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    path: Path = make_random_checkpoint(
        tmp_path_factory.mktemp("inv"), arch="llama", hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB)
    m = load_model(path)
    if request.param == "int4":
        rng = np.random.default_rng(0)
        for layer in m.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = _int4_like(attn.qkv_proj, rng), _int4_like(attn.o_proj, rng)
            mlp.gate_up_proj = _int4_like(mlp.gate_up_proj, rng)
            mlp.down_proj = _int4_like(mlp.down_proj, rng)
        values = rng.integers(-128, 128, size=(VOCAB, 64), dtype=np.int32)
        m.logits_head = Q8Split(values, rng.uniform(0.001, 0.01, (VOCAB, 2)).astype(np.float32))
    elif request.param.startswith("packed"):
        act = "q8" if request.param == "packed-q8" else "f32"
        for layer in m.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for owner, name in ((attn, "qkv_proj"), (attn, "o_proj"), (mlp, "gate_up_proj"),
                                (mlp, "down_proj")):
                setattr(owner, name, _ggml_like(getattr(owner, name).weight, "Q4_1", act))
        m.logits_head = _ggml_like(m.model.embed_tokens.weight, "Q8_0", act)
    return m


def _alone_by_decode(model: CausalLM, prompt: list[int], decode: list[int]) -> list[torch.Tensor]:
    """Reference: the prompt in one chunk, then one token per step, by itself."""
    runner = ModelRunner(model, block_size=4, num_blocks=64)
    table = tuple(range(40))
    rows = [runner.execute([SeqChunk(tuple(prompt), 0, table, True)])[0]]
    for i, t in enumerate(decode):
        rows.append(runner.execute([SeqChunk((t,), len(prompt) + i, table, True)])[0])
    return rows


@settings(max_examples=3)
@given(seed=st.integers(0, 2**16), chunk=st.integers(2, 9))
def test_t4_crowd_chunking_and_paging_give_identical_logits(
    model: CausalLM, seed: int, chunk: int
) -> None:
    """T4: 16 sequences under random chunked prefill and continuous batching get exactly the
    logits each gets alone with a one-chunk prefill."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(16)]
    decodes = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 6))] for _ in prompts]
    runner = ModelRunner(model, block_size=4, num_blocks=400)
    got = run_schedule(runner, prompts, decodes, chunk=chunk, rng=rng)
    for p, d, rows in zip(prompts, decodes, got, strict=True):
        ref = _alone_by_decode(model, p, d)
        assert all(torch.equal(a, b) for a, b in zip(rows, ref, strict=True))


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> CausalLM:
    """SmolLM2-135M's attention shape (9 query heads, 3 KV heads, d_h 64), int4 linears."""
    path: Path = make_random_checkpoint(
        tmp_path_factory.mktemp("wide"), arch="llama", hidden_size=576, intermediate_size=256,
        num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, vocab_size=VOCAB)
    m = load_model(path)
    rng = np.random.default_rng(3)
    for layer in m.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj, attn.o_proj = _int4_like(attn.qkv_proj, rng), _int4_like(attn.o_proj, rng)
        mlp.gate_up_proj, mlp.down_proj = (_int4_like(mlp.gate_up_proj, rng),
                                           _int4_like(mlp.down_proj, rng))
    values = rng.integers(-128, 128, size=(VOCAB, 576), dtype=np.int32)
    m.logits_head = Q8Split(values, rng.uniform(0.001, 0.01, (VOCAB, 18)).astype(np.float32))
    return m


def test_t4_real_head_shape_prefill_blocks_crowd_and_chunks_equal_alone(
    wide_model: CausalLM,
) -> None:
    """T4 at the real head shape: prompts spanning several 64-key splits, prefilled in chunks
    of 37 next to other sequences' decode rows, give exactly the logits of the prompt in one
    chunk then decode, alone; and the long prompt's last logits equal those of the prompt fed
    token by token (every position by the decode path, padded gemm rows)."""
    rng = random.Random(8)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (150, 3, 70)]
    decodes = [[rng.randrange(3, VOCAB) for _ in range(3)] for _ in prompts]
    runner = ModelRunner(wide_model, block_size=4, num_blocks=200)
    got = run_schedule(runner, prompts, decodes, chunk=37, rng=rng)
    for p, d, rows in zip(prompts, decodes, got, strict=True):
        ref = _alone_by_decode(wide_model, p, d)
        assert all(torch.equal(a, b) for a, b in zip(rows, ref, strict=True))
    by_token = ModelRunner(wide_model, block_size=4, num_blocks=64)
    table = tuple(range(40))
    for i, t in enumerate(prompts[0]):
        last = by_token.execute([SeqChunk((t,), i, table, True)])[0]
    assert torch.equal(last, got[0][0])


def test_t4_recompute_after_preemption_is_bitwise_identical(model: CausalLM) -> None:
    """T4: decoded tokens recomputed as one prefill chunk (preemption by recompute, or a
    prefix-cache miss) leave the next logits bit-for-bit unchanged."""
    rng = random.Random(5)
    prompt = [rng.randrange(3, VOCAB) for _ in range(21)]
    decode = [rng.randrange(3, VOCAB) for _ in range(12)]
    ref = _alone_by_decode(model, prompt, decode)
    runner = ModelRunner(model, block_size=4, num_blocks=64)
    table = tuple(range(63, 23, -1))
    full = prompt + decode
    again = runner.execute([SeqChunk(tuple(full[:-1]), 0, table, True)])[0]
    last = runner.execute([SeqChunk((full[-1],), len(full) - 1, table, True)])[0]
    assert torch.equal(again, ref[-2]) and torch.equal(last, ref[-1])


def test_int4_linear_matches_its_dequantized_weights_and_rows_are_batch_free() -> None:
    """Int4Linear computes x @ dequantize(codes, scale, zero).T (bf16 tolerance), and a row's
    output is identical whatever the number of rows (1..300)."""
    rng = np.random.default_rng(1)
    n, k = 48, 96
    codes = rng.integers(0, 16, size=(n, k), dtype=np.int32)
    scale = rng.uniform(0.01, 0.1, size=(n, k // 32)).astype(np.float32)
    zero = rng.uniform(-1, 1, size=(n, k // 32)).astype(np.float32)
    lin = Int4Linear(codes, scale, zero)
    x = torch.randn(300, k)
    ref = x @ dequantize(codes, scale, zero, 8).T
    out = lin(x)
    assert (out - ref).abs().max() <= 0.02 * ref.abs().max()
    for m in (1, 2, 3, 7, 16, 33, 129):
        assert torch.equal(lin(x[:m]), out[:m]) and torch.equal(lin(x[-m:]), out[-m:])


def test_q8_split_is_the_q8_0_matrix_and_int8_head_is_close() -> None:
    """Q8Split reproduces the Q8_0 values exactly (up to bf16 rounding of the activations and
    outputs); the per-channel int8 opt-in is close but lossy."""
    rng = np.random.default_rng(2)
    values = rng.integers(-128, 128, size=(64, 64), dtype=np.int32)
    scale = np.full((64, 2), 0.0078125, dtype=np.float32)  # NOTE: a power of two: exact in bf16
    x = torch.randn(5, 64).bfloat16().float()
    ref = x @ dequantize(values, scale, np.zeros_like(scale), 0).T
    got = Q8Split(values, scale)(x)
    assert (got - ref).abs().max() <= 0.01 * ref.abs().max()
    w = dequantize(values, scale, np.zeros_like(scale), 0)
    assert (Int8Linear(w)(x) - ref).abs().max() <= 0.05 * ref.abs().max()
