"""ModelRunner: paging, chunked prefill and continuous batching preserve logical order (T3, T4)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.runner import ModelRunner, SeqChunk
from coda.models import attention_meta as attention_module
from coda.models.attention import AttentionMetadata, PagedKVCache
from coda.models.llama import CausalLM
from coda.models.loader import load_model
from tests.random_checkpoint import make_random_checkpoint

VOCAB = 320
ATOL = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("tiny"),
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
    )


@pytest.fixture(scope="module")
def model(model_dir: Path) -> CausalLM:
    return load_model(model_dir)


def alone(model: CausalLM, ids: list[int]) -> torch.Tensor:
    """Reference: every position's logits from ONE forward of the whole sequence, by itself."""
    cfg = model.config
    kv = PagedKVCache(
        num_layers=cfg.num_layers, num_blocks=len(ids), block_size=1,
        num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
    )  # fmt: skip
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(len(ids)))], 1)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(ids), meta.positions, meta, kv)).float()


def run_schedule(
    runner: ModelRunner,
    prompts: list[list[int]],
    decodes: list[list[int]],
    chunk: int,
    rng: random.Random,
) -> list[list[torch.Tensor]]:
    """Drive a continuous batch: chunked prefill, then decode; a random subset runs each step.

    Blocks come from a shuffled free list, so tables are non-contiguous and interleaved.
    Returns, per sequence, the logits after its prompt and after each decode token.
    """
    free = list(range(runner.num_blocks))
    rng.shuffle(free)
    seqs = [p + d for p, d in zip(prompts, decodes, strict=True)]
    done = [0] * len(seqs)  # tokens already in the cache
    tables: list[list[int]] = [[] for _ in seqs]
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    while any(done[i] < len(s) for i, s in enumerate(seqs)):
        active = [i for i, s in enumerate(seqs) if done[i] < len(s)]
        picked = [i for i in active if rng.random() < 0.7] or active[:1]
        chunks = []
        for i in picked:
            n_prompt = len(prompts[i])
            n = min(chunk, n_prompt - done[i]) if done[i] < n_prompt else 1
            end = done[i] + n
            while len(tables[i]) * runner.block_size < end:
                tables[i].append(free.pop())
            chunks.append(
                SeqChunk(tuple(seqs[i][done[i] : end]), done[i], tuple(tables[i]), end >= n_prompt)
            )
        logits = runner.execute(chunks)
        assert logits.dtype == torch.float32
        assert logits.shape == (sum(c.need_logits for c in chunks), VOCAB)
        rows = iter(logits)
        for i, c in zip(picked, chunks, strict=True):
            done[i] += len(c.token_ids)
            if c.need_logits:
                out[i].append(next(rows))
    return out


def check_against_alone(
    model: CausalLM,
    prompts: list[list[int]],
    decodes: list[list[int]],
    got: list[list[torch.Tensor]],
) -> None:
    for p, d, rows in zip(prompts, decodes, got, strict=True):
        ref = alone(model, p + d)[len(p) - 1 :]
        assert len(rows) == len(ref) == len(d) + 1
        torch.testing.assert_close(torch.stack(rows), ref, atol=ATOL, rtol=ATOL)


def test_t3_t4_mixed_batch_chunked_prefill_then_decode_matches_alone(model: CausalLM) -> None:
    """T3/T4: sequences of different lengths, prefill in chunks of 6 mixed with decode steps,
    shuffled non-contiguous blocks: next-token logits equal each sequence's solo forward."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 13, 22, 1)]
    decodes = [[rng.randrange(3, VOCAB) for _ in range(4)] for _ in prompts]
    runner = ModelRunner(model, block_size=4, num_blocks=64)
    got = run_schedule(runner, prompts, decodes, chunk=6, rng=rng)
    check_against_alone(model, prompts, decodes, got)


@settings(deadline=None, max_examples=25)
@given(
    lens=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    n_decode=st.integers(0, 3),
    chunk=st.integers(1, 9),
    block_size=st.sampled_from([1, 2, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_t4_any_chunking_batching_and_paging_preserves_logits(
    model: CausalLM, lens: list[int], n_decode: int, chunk: int, block_size: int, seed: int
) -> None:
    """T4 (property): any chunk size, batch composition, block size and block order."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]
    decodes = [[rng.randrange(VOCAB) for _ in range(n_decode)] for _ in lens]
    runner = ModelRunner(model, block_size=block_size, num_blocks=128 // block_size + 8)
    check_against_alone(model, prompts, decodes, run_schedule(runner, prompts, decodes, chunk, rng))


def test_t4_recompute_into_other_blocks_resumes_identically(model: CausalLM) -> None:
    """T4: a preempted sequence recomputed into different blocks continues with the same logits."""
    runner = ModelRunner(model, block_size=4, num_blocks=32)
    ids = list(range(10, 21))
    first = runner.execute([SeqChunk(tuple(ids), 0, (3, 17, 9), True)])
    cont = runner.execute([SeqChunk((42,), 11, (3, 17, 9), True)])
    redo = runner.execute([SeqChunk((*ids, 42), 0, (30, 1, 25, 8), True)])
    torch.testing.assert_close(cont, redo, atol=ATOL, rtol=ATOL)
    assert not torch.allclose(first, cont)


def test_t3_writes_land_only_in_owned_slots(model: CausalLM) -> None:
    """T3: a step appends K/V at exactly its tokens' slots; other blocks stay untouched."""
    runner = ModelRunner(model, block_size=4, num_blocks=16)
    runner.execute([SeqChunk(tuple(range(6)), 0, (9, 3), False), SeqChunk((7,), 0, (12,), True)])
    for layer_k in runner.kv.k:
        written = layer_k.abs().sum(dim=(0, -1)) != 0  # [num_blocks, block_size]
        expected = torch.zeros_like(written)
        expected[9, :] = True
        expected[3, :2] = True
        expected[12, 0] = True
        assert torch.equal(written, expected)


@pytest.mark.parametrize("dtype,size", [("float32", 4), ("bfloat16", 2)])
def test_t3_kv_bytes_per_token_formula(model_dir: Path, dtype: str, size: int) -> None:
    """T3: the cache grows by 2·L·H_kv·d_h scalars per token; sizing by bytes follows it."""
    runner = ModelRunner.from_dir(model_dir, dtype=dtype, block_size=8, kv_cache_bytes=1 << 20)
    cfg = runner.config
    assert runner.kv_bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size
    assert runner.num_blocks == (1 << 20) // (8 * runner.kv_bytes_per_token)
    assert runner.kv.nbytes == runner.num_blocks * 8 * runner.kv_bytes_per_token
    logits = runner.execute([SeqChunk((1, 2, 3), 0, (0,), True)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


def test_execute_rejects_bad_chunks_and_returns_editable_logits(model: CausalLM) -> None:
    runner = ModelRunner(model, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="too short"):
        runner.execute([SeqChunk(tuple(range(5)), 0, (1,), True)])
    with pytest.raises(ValueError, match="out of range"):
        runner.execute([SeqChunk((1,), 0, (8,), True)])
    with pytest.raises(ValueError, match=">= 1 token"):
        runner.execute([SeqChunk((), 0, (1,), True)])
    assert runner.execute([]).shape == (0, VOCAB)
    assert runner.execute([SeqChunk((1,), 0, (0,), False)]).shape == (0, VOCAB)
    logits = runner.execute([SeqChunk((1, 2), 0, (0,), True)])
    logits.add_(1.0)  # NOTE: not an inference tensor, so a sampler may edit it in place
    assert runner.forward_time_s > 0


def test_t4_one_decode_call_per_layer_whatever_the_lengths() -> None:
    """T4 (performance contract): every decode row shares one attention call, whatever the
    mix of key lengths; prefill chunks are cut into query blocks by key split, block j
    attending splits 0..j only; a decode-only batch in order needs no row index."""
    n = 64
    meta = AttentionMetadata.build(
        [1] * n, [40] * (n - 1) + [300], [list(range(19))] * n, 16
    )
    assert meta.prefill is None and meta.decode is not None
    decode = meta.decode
    assert decode.num_seqs == n and decode.num_splits * decode.split >= 300
    assert decode.tokens is None  # rows are tokens 0..T-1
    # NOTE: row 0 (40 keys) lives in split 0: its splits 1.. are dead; row 63 (300 keys) none
    assert decode.dead is not None
    assert decode.dead[0, 0, :, 0, 0].tolist() == [False, True, True, True, True]
    assert not decode.dead[0, n - 1].any()
    assert AttentionMetadata.build([1, 1], [40, 50], [[0, 1, 2, 3]] * 2, 16).decode.dead is None  # type: ignore[union-attr]
    mixed = AttentionMetadata.build([1, 1, 43], [40, 41, 143], [list(range(3 * i, 3 * i + 9))
                                                                for i in range(3)], 16)
    assert mixed.decode is not None and mixed.decode.num_seqs == 2
    assert mixed.decode.tokens is not None and mixed.decode.tokens.tolist() == [0, 1]
    assert mixed.prefill is not None
    # NOTE: positions 100..142 fall in splits 1 (100..127) and 2 (128..142)
    blocks = [(b.split_index, b.rows, b.out_tokens.tolist()) for b in mixed.prefill.blocks]
    assert blocks == [(1, 28, list(range(2, 30))), (2, 15, list(range(30, 45)))]


@pytest.mark.parametrize("split_keys", [1, 3, 64])
def test_t4_every_split_size_preserves_logits(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch, split_keys: int
) -> None:
    """T4: whatever the attention split size (one key per split, a split straddling blocks, or
    the default), decode rows of very different lengths next to prefill chunks still equal the
    solo forward."""
    monkeypatch.setattr(attention_module, "_SPLIT_KEYS", split_keys)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (2, 9, 33, 70, 3)]
    decodes = [[rng.randrange(3, VOCAB) for _ in range(5)] for _ in prompts]
    runner = ModelRunner(model, block_size=2, num_blocks=128)
    got = run_schedule(runner, prompts, decodes, chunk=7, rng=rng)
    check_against_alone(model, prompts, decodes, got)
