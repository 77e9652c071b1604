"""Qwen3 through the one decoder with the family fixture pattern (issue 19 item 1; SPEC T3,
K2): a tiny random ``Qwen3ForCausalLM`` folder (per-head q/k RMSNorm before RoPE, head_dim 32
with hidden 64, so not hidden / heads) with transformers' eager logits as the oracle, a GGUF
holding the same weights as llama.cpp writes a Qwen3 file (q/k rows unpermuted,
``attn_q_norm``/``attn_k_norm``) giving Coda the folder's logits within 1e-4, prefill and
decode through the paged cache, and a chat from the file's ChatML template through the
official openai and anthropic clients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from coda.engine.runner import ModelRunner
from coda.models.config import ModelConfig
from coda.models.gguf_file import open_gguf
from coda.models.gguf_weights import load_gguf_model
from coda.models.loader import load_model
from coda.models.tokenizer_bundle import bundle_from_gguf
from tests.family_fixtures import chat_through_both_sdks, folder_to_gguf, greedy_steps
from tests.random_checkpoint import make_random_checkpoint
from tests.test_models import full_forward, hf_logits

PROMPT = [(i * 37 + 11) % 300 + 10 for i in range(30)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("qwen3") / "tiny-qwen3", arch="qwen3", vocab_size=320, seed=3,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rope_theta=1_000_000.0)


@pytest.fixture(scope="module")
def qwen3_gguf(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return folder_to_gguf(folder, tmp_path_factory.mktemp("qwen3-gguf") / "tiny-qwen3.gguf",
                          "qwen3")


def test_t3_qwen3_folder_and_gguf_give_transformers_logits(folder: Path,
                                                           qwen3_gguf: Path) -> None:
    """The folder and its GGUF give transformers' logits within 1e-4; the file's config is
    the folder's; without the q/k norms the logits move away (so the norms are exercised)."""
    cfg = ModelConfig.from_dir(folder)
    assert cfg.qk_norm and cfg.head_dim == 32 and cfg.hidden_size // cfg.num_heads == 16
    from_file = open_gguf(qwen3_gguf).config
    differing = {k for k, v in vars(from_file).items() if vars(cfg)[k] != v}
    assert differing <= {"rms_norm_eps"}, differing
    ref = hf_logits(folder, PROMPT, torch.float32)
    assert ref.std() > 0.3
    model = load_model(folder)
    assert (full_forward(model, PROMPT) - ref).abs().max().item() <= 1e-4
    assert (full_forward(load_gguf_model(qwen3_gguf), PROMPT) - ref).abs().max().item() <= 1e-4
    for layer in model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert (full_forward(model, PROMPT) - ref).abs().max().item() > 1e-3


def test_t3_qwen3_gguf_decode_through_the_paged_cache(folder: Path, qwen3_gguf: Path) -> None:
    """Prefill then greedy decode from the GGUF through the runner: each step's logits within
    1e-4 of transformers' on the whole sequence."""
    runner = ModelRunner(load_gguf_model(qwen3_gguf), num_blocks=4, block_size=16)
    tokens, logits = greedy_steps(runner, PROMPT, 10)
    ref = hf_logits(folder, PROMPT + tokens, torch.float32)[len(PROMPT) - 1: -1]
    assert (logits - ref).abs().max().item() <= 1e-4


def test_k2_qwen3_gguf_chat_from_the_files_template_through_both_sdks(qwen3_gguf: Path) -> None:
    """A chat on the tiny Qwen3 GGUF over loopback: the file's ChatML template, ``<|im_end|>``
    ends a turn, and the official openai and anthropic clients get the same greedy reply."""
    bundle = bundle_from_gguf(open_gguf(qwen3_gguf))
    end = bundle.tokenizer.token_to_id("<|im_end|>")
    assert bundle.chat_template_origin == "GGUF tokenizer.chat_template"
    assert end in bundle.eos_token_ids
    messages: list[Any] = [{"role": "user", "content": "the quick brown fox"}]
    prompt, reply, message = chat_through_both_sdks(qwen3_gguf, messages)
    assert prompt == "<|im_start|>user\nthe quick brown fox<|im_end|>\n<|im_start|>assistant\n"
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids.count(end) == 1 and reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids)
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == reply.choices[0].message.content
