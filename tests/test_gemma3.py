"""Gemma 3 (text) through the one decoder (issue 19 item 1; SPEC T3, T4, K2).

A tiny random ``Gemma3ForCausalLM`` folder (7 layers: local layers 0-4 and 6, global layer 5;
window 8; head_dim 256; query_pre_attn_scalar 64, not head_dim) with transformers' eager
implementation as the oracle, on prompts five times the window and while decoding past it; a
GGUF holding the same weights as llama.cpp writes them (norms stored as ``w + 1``, Gemma's
SentencePiece vocabulary without a space prefix) giving the folder's logits; the engine's
batching, chunking and prefix cache giving each request its tokens alone; and a chat served
to the official ``openai`` and ``anthropic`` clients."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from coda.engine.runner import ModelRunner
from coda.models.config import ModelConfig
from coda.models.gguf_file import open_gguf
from coda.models.gguf_weights import load_gguf_model
from coda.models.loader import load_model
from coda.models.tokenizer_bundle import GEMMA_CHAT_TEMPLATE, bundle_from_gguf, bundle_from_hf_dir
from tests.family_fixtures import add_hparams, chat_through_both_sdks, greedy_steps
from tests.random_checkpoint import make_random_checkpoint
from tests.spm_vocab_fixture import add_gemma_spm_vocab
from tests.test_models import full_forward, hf_logits

WINDOW, LAYERS, VOCAB = 8, 7, 300
PROMPT = [(i * 37 + 11) % (VOCAB - 40) + 30 for i in range(40)]
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PIECES = ([chr(c) for c in range(ord("a"), ord("z") + 1)]
          + ["▁", "▁t", "ld", "▁the", "he", "ll", "llo", "hello", "▁w", "or", "orld", "▁world"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(
        tmp_path_factory.mktemp("gemma3") / "tiny-gemma3", arch="gemma3", vocab_size=VOCAB,
        hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, intermediate_size=96, max_position_embeddings=512, sliding_window=WINDOW,
        query_pre_attn_scalar=64, rms_norm_eps=1e-6, seed=7)


def write_gemma_gguf(folder: Path, path: Path) -> Path:
    """The folder's weights as llama.cpp's converter writes a Gemma 3 GGUF: every norm + 1
    (q/k norms included), gemma3.* metadata, Gemma's SentencePiece vocabulary layout
    (specials, the 256 byte tokens, pieces with scores; no space prefix; BOS added)."""
    cfg = ModelConfig.from_dir(folder)
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_hparams(w, cfg, "gemma3")
    w.add_sliding_window(WINDOW)
    tokens = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    assert len(tokens) == VOCAB
    types = [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(PIECES)
    scores = [0.0] * (len(SPECIALS) + 256) + [-100.0 + len(p) for p in PIECES]
    add_gemma_spm_vocab(w, tokens, types, scores)
    # NOTE: no tokenizer.chat_template, as in the real Gemma 3 270M file: the family format
    names = {"model.embed_tokens.weight": "token_embd.weight",
             "model.norm.weight": "output_norm.weight"}
    layer = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, t in sorted(load_file(str(folder / "model.safetensors")).items()):
        arr = t.float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + np.float32(1.0)  # NOTE: llama.cpp's converter stores w + 1
        if name not in names:
            _, _, i, rest = name.split(".", 3)
            names[name] = f"blk.{i}.{layer[rest.removesuffix('.weight')]}.weight"
        w.add_tensor(names[name], np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def gemma_gguf(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gemma_gguf(folder, tmp_path_factory.mktemp("gemma3-gguf") / "tiny-gemma3.gguf")


def test_t3_gemma3_config_layer_pattern_and_numerics(folder: Path, gemma_gguf: Path) -> None:
    """Layer i is global when (i + 1) % 6 == 0 (transformers' layer_types, llama.cpp's
    pattern); the window is exact, so it does not cap the context; the GGUF's config equals
    the folder's except the norm offset (its file stores w + 1)."""
    from transformers import Gemma3TextConfig

    cfg = ModelConfig.from_dir(folder)
    hf = Gemma3TextConfig.from_pretrained(folder)
    assert cfg.local_layers == tuple(i for i, t in enumerate(hf.layer_types)
                                     if t == "sliding_attention") == (0, 1, 2, 3, 4, 6)
    assert (cfg.local_window, cfg.rope_theta, cfg.rope_local_theta) == (WINDOW, 1e6, 1e4)
    assert cfg.attn_scale == 64 ** -0.5 and cfg.head_dim == 256 and cfg.tie_word_embeddings
    assert cfg.max_context == 512 and cfg.norm_weight_offset == 1.0
    from_file = open_gguf(gemma_gguf).config
    assert from_file.norm_weight_offset == 0.0
    differing = {k for k, v in vars(from_file).items() if vars(cfg)[k] != v}
    # NOTE: llama.cpp fixes the query scale at head_dim ** -0.5 below 27B; eos/bos/dtype come
    # from the tokenizer metadata
    assert differing <= {"norm_weight_offset", "attn_scale", "bos_token_id", "eos_token_ids",
                         "torch_dtype", "rms_norm_eps"}, differing
    assert from_file.rms_norm_eps == pytest.approx(cfg.rms_norm_eps, rel=1e-6)  # NOTE: float32
    assert from_file.attn_scale == 256 ** -0.5


def test_t3_gemma3_prompt_logits_equal_transformers(folder: Path) -> None:
    """A 40-token prompt (five windows): every position's logits within 1e-4 of transformers'
    eager Gemma 3. With the window switched off in Coda the logits move far from the oracle:
    the local mask is really exercised."""
    model = load_model(folder)
    ref = hf_logits(folder, PROMPT, torch.float32)
    assert (full_forward(model, PROMPT) - ref).abs().max().item() <= 1e-4
    for layer in model.model.layers:
        layer.self_attn.local = False  # NOTE: full attention everywhere: must differ
    assert (full_forward(model, PROMPT) - ref).abs().max().item() > 1e-2


def test_t3_gemma3_decode_past_the_window_equals_transformers(folder: Path) -> None:
    """Greedy decoding 20 tokens after the 40-token prompt through the paged cache: each
    step's logits within 1e-4 of transformers' on the whole sequence, so the same tokens."""
    runner = ModelRunner(load_model(folder), num_blocks=8, block_size=16)
    tokens, logits = greedy_steps(runner, PROMPT, 20)
    ref = hf_logits(folder, PROMPT + tokens, torch.float32)[len(PROMPT) - 1: -1]
    assert (logits - ref).abs().max().item() <= 1e-4
    assert tokens == ref.argmax(-1).tolist()


def test_t3_gemma3_gguf_gives_the_folders_logits(folder: Path, gemma_gguf: Path) -> None:
    """The same weights from the GGUF (norms applied as stored, w + 1): the folder's logits
    within 1e-4 (llama.cpp's query scale equals the folder's only at head_dim, so the folder
    is compared with its own scale swapped for the file's)."""
    from_file = load_gguf_model(gemma_gguf)
    from_dir = load_model(folder)
    for layer in from_dir.model.layers:
        layer.self_attn.scale = from_file.config.attn_scale
    got = full_forward(from_file, PROMPT)
    assert (got - full_forward(from_dir, PROMPT)).abs().max().item() <= 1e-4
    runner = ModelRunner(from_file, num_blocks=8, block_size=16)
    assert len(greedy_steps(runner, PROMPT, 12)[0]) == 12


def test_k2_gemma3_gguf_tokenizer_no_space_prefix_bos_and_turn_end(gemma_gguf: Path) -> None:
    """Gemma's SentencePiece file: add_space_prefix false is honoured (no leading ▁), BOS is
    added, bytes fall back to <0xNN>, <end_of_turn> ends a turn next to <eos>, and a file
    without a template is served Gemma's turn format (said in its origin)."""
    bundle = bundle_from_gguf(open_gguf(gemma_gguf))
    tok = bundle.tokenizer
    enc = tok.encode("hello the world!")
    assert enc.tokens == ["<bos>", "hello", "▁the", "▁world", "<0x21>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello the world!"
    assert bundle.eos_token_ids == {1, 5}
    assert bundle.chat_template == GEMMA_CHAT_TEMPLATE and "gemma3" in bundle.chat_template_origin


def test_gemma3_folder_template_turn_end_is_an_end_id(folder: Path, tmp_path: Path) -> None:
    """An HF folder whose template ends turns with <end_of_turn> ends generation there even
    when config.json and generation_config.json list only <eos>."""
    import shutil

    from tokenizers import AddedToken, Tokenizer

    target = tmp_path / "with-gemma-template"
    shutil.copytree(folder, target)
    tok = Tokenizer.from_file(str(target / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<end_of_turn>", special=True)])
    tok.save(str(target / "tokenizer.json"))
    (target / "chat_template.jinja").write_text(GEMMA_CHAT_TEMPLATE, encoding="utf-8")
    bundle = bundle_from_hf_dir(target, ModelConfig.from_dir(target))
    assert tok.token_to_id("<end_of_turn>") in bundle.eos_token_ids
    assert tok.token_to_id("<end_of_turn>") not in bundle_from_hf_dir(
        folder, ModelConfig.from_dir(folder)).eos_token_ids


def _engine_tokens(loaded: Any, reqs: list[Any], *, twice: bool = False,
                   **config: Any) -> tuple[list[tuple[int, ...]], int]:
    """Every request's tokens from one started engine over ``loaded`` (all submitted at once;
    ``twice``: the crowd again after it ended, its prompts then in the prefix cache), and the
    prompt tokens the prefix cache served."""
    from tests.engine_support import outcome_of
    from tests.invariance import engine_on

    tokens, cached = [], 0
    with engine_on(loaded, 64, block_size=16, max_num_seqs=len(reqs), **config) as engine:
        engine.start()
        for _ in range(2 if twice else 1):
            handles = [engine.submit(r) for r in reqs]
            tokens = []
            for h in handles:
                cached += h.wait(600).usage.cached_prompt_tokens
                tokens.append(outcome_of(h.stream).token_ids)
    return tokens, cached


def test_t4_gemma3_engine_batching_chunking_prefix_cache_keep_tokens(folder: Path) -> None:
    """Through the engine: a crowd, chunked prefill (chunks of 7, across window edges, next to
    other rows decoding) and prefix-cache hits (a prompt's window reaching into cached blocks)
    give every greedy request the tokens it gets alone."""
    from coda.engine.types import GenerationRequest
    from coda.models.source import open_model, resolve_model
    from coda.sampling import SamplingParams

    loaded = open_model(resolve_model(folder))
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [GenerationRequest(tuple((PROMPT * 2)[i: i + n]), greedy, max_tokens=12)
            for i, n in enumerate((1, 7, 9, 17, 40, 33, 70))]
    alone = [_engine_tokens(loaded, [r], enable_prefix_caching=False)[0][0] for r in reqs]
    crowd, _ = _engine_tokens(loaded, reqs, enable_prefix_caching=False)
    chunked, _ = _engine_tokens(loaded, reqs, enable_prefix_caching=False,
                                max_num_batched_tokens=24, long_prefill_chunk=7)
    hit, cached = _engine_tokens(loaded, reqs, twice=True, enable_prefix_caching=True)
    assert cached >= 16 * 5
    assert crowd == alone and chunked == alone and hit == alone


def test_gemma3_gguf_chat_through_both_sdks(gemma_gguf: Path) -> None:
    """A chat on the tiny Gemma 3 GGUF served over loopback to the official openai and
    anthropic clients: the prompt is Gemma's turn format (BOS once), the reply is streamed to
    its end, and both clients get the same greedy reply."""
    messages: list[Any] = [{"role": "user", "content": "hello the world"}]
    text, reply, message = chat_through_both_sdks(gemma_gguf, messages, max_tokens=16)
    assert text == "<bos><start_of_turn>user\nhello the world<end_of_turn>\n" \
                   "<start_of_turn>model\n"
    tok = bundle_from_gguf(open_gguf(gemma_gguf)).tokenizer
    prompt_ids = tok.encode(text, add_special_tokens=False).ids
    assert prompt_ids.count(2) == 1 and reply.usage is not None
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert "".join(b.text for b in message.content if b.type == "text") == \
        reply.choices[0].message.content
