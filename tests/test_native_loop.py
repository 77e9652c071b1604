"""The fused native layer loop (``coda/models/native_loop.py``; issue 18 item 3; SPEC T3, T4)
gives the per-op loop's bits.

``CausalLM.forward`` runs the decoder as bare native calls where every projection carries a
``RawLinear`` (packed GGUF kernels, the fp32-kernel mode). It must be the per-op loop
(``fused_loop = False``) bit for bit: the same logits at every step of a schedule that mixes
prefill chunks and decode rows of two sequences, and the same KV cache after it. Checked on
SmolLM2-135M Q4_1 (``packed``) and, for the options SmolLM2 lacks (per-head q/k norms, sandwich
norms, GELU-tanh gate, sliding-window layers on their own RoPE table, a query scale), on tiny
random Qwen3 and Gemma 3 models in the fp32-kernel mode. The loop is really taken there, and
not where a projection is a plain ``F.linear``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coda.models import kernels

if (_why := kernels.unavailable()) is not None:  # NOTE: CI sets CODA_REQUIRE_NATIVE (conftest)
    pytest.skip(f"native kernels unavailable: {_why}", allow_module_level=True)

from coda.engine.runner import ModelRunner, SeqChunk  # noqa: E402
from coda.models.dense_invariant import make_invariant  # noqa: E402
from coda.models.llama import CausalLM  # noqa: E402
from coda.models.loader import load_model  # noqa: E402
from coda.models.native_loop import NativeLoop  # noqa: E402
from coda.models.source import open_model, resolve_model  # noqa: E402
from tests.random_checkpoint import make_random_checkpoint  # noqa: E402

VOCAB = 300


def _schedule(model: CausalLM, fused: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Two sequences: A prefills 21 tokens while B prefills 7; then A decodes while B prefills
    5 more; then both decode 6 greedy steps. Every step's logits and the final cache."""
    model.fused_loop = fused
    runner = ModelRunner(model, num_blocks=16, block_size=4, num_threads=1)
    assert runner.native_attention
    ta, tb = tuple(range(8)), tuple(range(8, 16))
    a = [(i * 37 + 11) % (VOCAB - 40) + 30 for i in range(21)]
    b = [(i * 53 + 7) % (VOCAB - 40) + 30 for i in range(12)]
    steps = [runner.execute([SeqChunk(tuple(a), 0, ta, True),
                             SeqChunk(tuple(b[:7]), 0, tb, False)])]
    a.append(int(steps[-1][0].argmax()))
    steps.append(runner.execute([SeqChunk((a[-1],), len(a) - 1, ta, True),
                                 SeqChunk(tuple(b[7:]), 7, tb, True)]))
    for _ in range(6):
        a.append(int(steps[-1][0].argmax()))
        b.append(int(steps[-1][1].argmax()))
        steps.append(runner.execute([SeqChunk((a[-1],), len(a) - 1, ta, True),
                                     SeqChunk((b[-1],), len(b) - 1, tb, True)]))
    return steps, runner.kv._storage.clone()


def _taken(model: CausalLM) -> bool:
    model.fused_loop = True
    return model.native_loop(model.rows, model.layer_plan(model.rows)) is not None


def _same_bits(model: CausalLM) -> None:
    assert _taken(model)
    calls = [0]
    real = NativeLoop.run

    def counted(self: NativeLoop, *args: Any) -> torch.Tensor:
        calls[0] += 1
        return real(self, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NativeLoop, "run", counted)
        fused, fused_kv = _schedule(model, True)
        assert calls[0] == 8  # NOTE: every step ran the fused loop ...
        per_op, per_op_kv = _schedule(model, False)
        assert calls[0] == 8  # NOTE: ... and the reference none
    # NOTE: one row per chunk that asks (B's first chunk does not): the runner hands the head
    # only those rows (a decode-only step: every row, uncopied)
    assert [s.shape[0] for s in fused] == [s.shape[0] for s in per_op] == [1] + [2] * 7
    for got, want in zip(fused, per_op, strict=True):
        assert torch.equal(got, want)
    assert torch.equal(fused_kv, per_op_kv)


def test_t4_smollm2_packed_fused_loop_has_the_per_op_bits(smollm_gguf: Path) -> None:
    """SmolLM2-135M Q4_1 in the default exact mode (packed): the fused loop runs and gives
    the per-op loop's logits and cache, bit for bit, over prefill, mixed and decode steps."""
    model = open_model(resolve_model(str(smollm_gguf)), quant="packed").model
    _same_bits(model)


def test_t4_qwen3_fused_loop_has_the_per_op_bits(tmp_path: Path) -> None:
    """Qwen3 (per-head q/k norms before RoPE) in the fp32-kernel mode, fused = per-op."""
    path = make_random_checkpoint(tmp_path / "tiny-qwen3", arch="qwen3", vocab_size=VOCAB,
                                  seed=3)
    model = make_invariant(load_model(path))
    assert model.config.qk_norm
    _same_bits(model)


def test_t4_gemma3_fused_loop_has_the_per_op_bits(tmp_path: Path) -> None:
    """Gemma 3 (q/k norms, sandwich norms, GELU-tanh gate, query scale, window-4 local layers
    on their own RoPE base, decoding past the window) in the fp32-kernel mode, fused = per-op."""
    path = make_random_checkpoint(
        tmp_path / "tiny-gemma3", arch="gemma3", vocab_size=VOCAB, hidden_size=64,
        num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        intermediate_size=96, max_position_embeddings=512, sliding_window=4,
        query_pre_attn_scalar=64, rms_norm_eps=1e-6, seed=7)
    model = make_invariant(load_model(path))
    cfg = model.config
    assert cfg.local_layers and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh"
    _same_bits(model)


def test_fused_loop_not_taken_for_plain_linears(tmp_path: Path) -> None:
    """A dense model's ``F.linear`` projections carry no RawLinear: the per-op loop runs."""
    path = make_random_checkpoint(tmp_path / "tiny-qwen3", arch="qwen3", vocab_size=VOCAB,
                                  seed=3)
    assert not _taken(load_model(path))
