"""Phi-3 / Phi-3.5 / Phi-4-mini (``phi3``) through the one decoder (issue 19 item 1; SPEC T3,
K2).

A tiny random ``Phi3ForCausalLM`` folder shaped like Phi-4-mini (fused ``qkv_proj`` and
``gate_up_proj``, partial rotary 3/4 of head_dim, LongRoPE short/long factors, tied
embeddings) with transformers' eager logits as the oracle, and a GGUF holding the same weights
as llama.cpp's converter writes it (``attn_qkv``, ``ffn_up`` = gate and up, the factors as
``rope_factors_short``/``rope_factors_long`` tensors, ``rope.dimension_count``, the attention
factor; no ``rope.scaling.type``): Coda gives the folder's logits from both within 1e-4, with the
short factors up to the original context and the long ones past it. A chat is served from the
file's own Phi-3 template to the official openai and anthropic clients."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from coda.models.attention import native_attention_refusal
from coda.models.config import ModelConfig
from coda.models.gguf_file import open_gguf
from coda.models.gguf_weights import load_gguf_model
from coda.models.llama import CausalLM
from coda.models.loader import load_model
from coda.models.rope_scaling import longrope_attention_factor
from coda.models.tokenizer_bundle import bundle_from_gguf
from tests.family_fixtures import chat_through_both_sdks, folder_to_gguf, greedy_steps
from tests.random_checkpoint import SPECIAL_TOKENS, build_bpe_tokenizer_json
from tests.random_checkpoint import make_random_checkpoint as make_checkpoint
from tests.test_models import full_forward, hf_logits

ORIG, MAX_POS, VOCAB = 32, 128, 320
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
LONG = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]
PHI_SPECIALS = ("<|user|>", "<|assistant|>", "<|end|>", "<|system|>")
# NOTE: Phi-3's turn format, written for this test: each turn '<|role|>\n' text '<|end|>\n'
PHI3_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + "
                 "'<|end|>\n' }}{% endfor %}{% if add_generation_prompt %}"
                 "{{ '<|assistant|>\n' }}{% endif %}")
SHORT_PROMPT = [(i * 29 + 5) % 300 + 10 for i in range(ORIG)]
LONG_PROMPT = [(i * 41 + 3) % 300 + 10 for i in range(ORIG + 12)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("phi3")
    tok = root / "tokenizer.json"
    tok.write_text(build_bpe_tokenizer_json(VOCAB, SPECIAL_TOKENS + PHI_SPECIALS),
                   encoding="utf-8")
    out = make_checkpoint(
        root / "tiny-phi3", arch="phi3", tokenizer_json=str(tok), seed=5, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POS,
        original_max_position_embeddings=ORIG, partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG})
    (out / "chat_template.jinja").write_text(PHI3_TEMPLATE, encoding="utf-8")
    return out


def _phi3_kv(w: gguf.GGUFWriter) -> None:
    """What llama.cpp's converter adds for a LongRoPE Phi-3: the original context and the
    attention factor, and a sliding window of 0 (none, as for Phi-4)."""
    w.add_rope_scaling_orig_ctx_len(ORIG)
    w.add_rope_scaling_attn_factors(longrope_attention_factor(MAX_POS / ORIG, ORIG))
    w.add_sliding_window(0)


@pytest.fixture(scope="module")
def phi3_gguf(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("phi3-gguf") / "tiny-phi3.gguf"
    factors = {"rope_factors_long.weight": np.array(LONG, np.float32),
               "rope_factors_short.weight": np.array(SHORT, np.float32)}
    return folder_to_gguf(folder, path, "phi3", kv=_phi3_kv, tensors=factors)


def _long(model: CausalLM) -> CausalLM:
    """The same weights served with LongRoPE's long factors (the whole context)."""
    cfg = model.config
    assert cfg.rope_scaling is not None
    long = CausalLM(dataclasses.replace(
        cfg, rope_scaling=dataclasses.replace(cfg.rope_scaling, long=True)))
    long.load_state_dict(model.state_dict())
    return long.eval()


def test_t3_phi3_config_from_folder_and_file(folder: Path, phi3_gguf: Path) -> None:
    """Fused checkpoint tensors, 12 of 16 dimensions rotated, LongRoPE with transformers'
    attention factor, the context capped at the original length with the short factors (the
    whole of it with the long ones); the file's config equals the folder's."""
    cfg = ModelConfig.from_dir(folder)
    rs = cfg.rope_scaling
    assert cfg.arch == "phi3" and cfg.fused_checkpoint and cfg.rope_dim == 12
    assert rs is not None and rs.kind == "longrope" and not rs.long
    assert rs.short_factor == tuple(SHORT) and rs.long_factor == tuple(LONG)
    assert rs.attention_factor == pytest.approx((1 + np.log(4) / np.log(32)) ** 0.5)
    assert cfg.max_context == ORIG
    assert dataclasses.replace(cfg, rope_scaling=dataclasses.replace(rs, long=True)
                               ).max_context == MAX_POS
    from_file = open_gguf(phi3_gguf).config
    differing = {k for k, v in vars(from_file).items() if vars(cfg)[k] != v}
    assert differing <= {"rope_scaling", "rms_norm_eps"}, differing
    assert from_file.rope_scaling is not None
    assert from_file.rope_scaling.attention_factor == pytest.approx(rs.attention_factor)
    got = from_file.rope_scaling
    assert (got.kind, got.factor, got.original_max_position_embeddings, got.long) == \
        (rs.kind, rs.factor, rs.original_max_position_embeddings, rs.long)
    # NOTE: the file's factors are float32
    assert got.short_factor == pytest.approx(SHORT) and got.long_factor == pytest.approx(LONG)


def test_t3_phi3_short_factors_logits_equal_transformers(folder: Path, phi3_gguf: Path) -> None:
    """Up to the original context (transformers picks the short factors): the folder and the
    GGUF give transformers' logits within 1e-4; the long factors, or full rotary, do not."""
    ref = hf_logits(folder, SHORT_PROMPT, torch.float32)
    assert ref.std() > 0.3
    model = load_model(folder)
    assert (full_forward(model, SHORT_PROMPT) - ref).abs().max().item() <= 1e-4
    from_file = load_gguf_model(phi3_gguf)
    assert (full_forward(from_file, SHORT_PROMPT) - ref).abs().max().item() <= 1e-4
    assert (full_forward(_long(model), SHORT_PROMPT) - ref).abs().max().item() > 1e-3
    full = CausalLM(dataclasses.replace(model.config, rotary_dim=None,
                                        rope_scaling=None)).eval()
    full.load_state_dict(model.state_dict())
    assert (full_forward(full, SHORT_PROMPT) - ref).abs().max().item() > 1e-3


def test_t3_phi3_long_factors_past_the_original_context(folder: Path, phi3_gguf: Path) -> None:
    """Past the original context (transformers switches to the long factors): Coda serving
    the long factors gives its logits within 1e-4, from the folder and from the file."""
    ref = hf_logits(folder, LONG_PROMPT, torch.float32)
    for model in (load_model(folder), load_gguf_model(phi3_gguf)):
        assert (full_forward(_long(model), LONG_PROMPT) - ref).abs().max().item() <= 1e-4


def test_t3_phi3_max_model_len_past_the_original_serves_the_long_factors(
        folder: Path, phi3_gguf: Path) -> None:
    """Issue 19: ``--max-model-len`` beyond ``original_max_position_embeddings`` serves
    LongRoPE's long factors (it was capped at the original 32 positions, the long factors never
    enabled). From the folder and from the GGUF, the engine serves the asked context and a
    44-token prompt then 8 greedy steps (past the original length) give transformers' Phi3
    logits within 1e-4 at every step, so its tokens; the load summary and the model identity
    say so. At the original length the short factors and their cap stay."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    for path in (folder, phi3_gguf):
        engine = AsyncEngine.from_model_dir(path, EngineConfig(max_model_len=MAX_POS,
                                                               max_num_seqs=1))
        rs = engine.runner.config.rope_scaling
        assert rs is not None and rs.long and engine.context_length == MAX_POS
        assert "LongRoPE long factors" in str(engine.load_summary()["rope"])
        assert any(line.startswith("rope: LongRoPE long factors") for line in engine.describe())
        tokens, logits = greedy_steps(engine.runner, LONG_PROMPT, 8)
        ref = hf_logits(folder, LONG_PROMPT + tokens, torch.float32)[len(LONG_PROMPT) - 1: -1]
        assert (logits - ref).abs().max().item() <= 1e-4
        assert tokens == ref.argmax(-1).tolist()
        short = AsyncEngine.from_model_dir(path, EngineConfig(max_model_len=ORIG, max_num_seqs=1))
        rs = short.runner.config.rope_scaling
        assert rs is not None and not rs.long and short.context_length == ORIG
        assert "rope" not in short.load_summary()
        assert short.model_snapshot != engine.model_snapshot


def test_phi3_partial_rotary_falls_back_from_the_native_kernel(folder: Path) -> None:
    """The native row kernel rotates whole heads: a partial-rotary model runs its attention
    in Python, and says why (the load summary's attention line)."""
    from coda.engine.runner import ModelRunner

    cfg = ModelConfig.from_dir(folder)
    why = native_attention_refusal(cfg, torch.float32, torch.device("cpu"))
    assert why is not None and "partial rotary (12 of 16" in why
    runner = ModelRunner(load_model(folder), num_blocks=4, block_size=16)
    assert not runner.native_attention and "partial rotary" in runner.attention_note
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    engine = AsyncEngine.from_model_dir(folder, EngineConfig(max_model_len=32, max_num_seqs=1))
    assert engine.load_summary()["attention"].startswith("torch (partial rotary (12 of 16")
    assert any(line.startswith("attention: torch (partial rotary") for line in engine.describe())


def test_t3_t4_phi3_full_rotary_longrope_on_the_native_kernel(tmp_path: Path) -> None:
    """Phi-3.5-mini's shape of RoPE (every dimension rotated, LongRoPE, the attention factor
    in the cos/sin tables) runs on the native row kernel: prefill then greedy decode through
    the paged cache, each step's logits within 1e-4 of transformers'."""
    from coda.engine.runner import ModelRunner

    factors = [1.0 + 0.25 * i for i in range(16)]
    folder = make_checkpoint(
        tmp_path / "phi35", arch="phi3", vocab_size=VOCAB, seed=9, hidden_size=128,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=MAX_POS,
        original_max_position_embeddings=ORIG,
        rope_scaling={"type": "longrope", "short_factor": factors,
                      "long_factor": [2 * f for f in factors]})
    runner = ModelRunner(load_model(folder), num_blocks=2, block_size=16)
    from coda.models.kernels import unavailable

    assert runner.native_attention == (unavailable() is None), runner.attention_note
    prompt = SHORT_PROMPT[:20]
    tokens, logits = greedy_steps(runner, prompt, 10)
    ref = hf_logits(folder, prompt + tokens, torch.float32)[len(prompt) - 1: -1]
    assert (logits - ref).abs().max().item() <= 1e-4


def test_k2_phi3_chat_from_the_files_template_through_both_sdks(phi3_gguf: Path) -> None:
    """A chat on the tiny Phi-3 GGUF over loopback: the prompt is the file's own template
    (``<|user|>`` … ``<|end|>``, each special once), ``<|end|>`` ends a turn, and the official
    openai and anthropic clients get the same greedy reply."""
    ckpt = open_gguf(phi3_gguf)
    bundle = bundle_from_gguf(ckpt)
    assert bundle.chat_template == PHI3_TEMPLATE
    assert bundle.chat_template_origin == "GGUF tokenizer.chat_template"
    end = bundle.tokenizer.token_to_id("<|end|>")
    assert end in bundle.eos_token_ids
    messages: list[Any] = [{"role": "user", "content": "the quick brown fox"}]
    # NOTE: the short factors serve 32 positions: prompt and reply fit in them
    prompt, reply, message = chat_through_both_sdks(phi3_gguf, messages, max_tokens=8)
    assert prompt == "<|user|>\nthe quick brown fox<|end|>\n<|assistant|>\n"
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids.count(end) == 1 and ids.count(bundle.tokenizer.token_to_id("<|user|>")) == 1
    assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].finish_reason in ("stop", "length")
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == reply.choices[0].message.content
    usage = message.usage  # NOTE: Anthropic counts prefix-cache reads apart
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == len(ids)
