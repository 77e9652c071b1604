"""Write a complete HF-style checkpoint with random weights (for tests and benchmarks).

``make_random_checkpoint`` writes ``config.json``, ``model.safetensors`` (HF tensor names),
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (ChatML
``chat_template``). The tokenizer is a byte-level BPE trained on a small built-in multilingual
text and then topped up with two-byte merge tokens so that EVERY model id decodes to bytes
(a random model samples all of its vocabulary). Ids 0, 1, 2 are ``<|endoftext|>`` (bos, eos),
``<|im_start|>``, ``<|im_end|>``; generation_config lists both ``<|endoftext|>`` and
``<|im_end|>`` as eos.

Weights are drawn with std 1/sqrt(fan_in) (norm weights around 1), so activations and
logits are O(1) and a random model's next-token distribution is not flat.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from coda.models.config import ModelConfig, hf_tensor_shapes
from coda.models.loader import torch_dtype

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# A small multilingual text (several scripts, digits, code, emoji) for training the tiny BPE.
_TRAIN_TEXT = """\
The quick brown fox jumps over the lazy dog. Streaming text must never split a character.
A language model predicts the next token; the server turns tokens back into bytes.
Le renard brun rapide saute par-dessus le chien paresseux. Où est la bibliothèque ?
Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übermut.
El rápido zorro marrón salta sobre el perro perezoso. ¿Dónde está la estación?
Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир!
敏捷的棕色狐狸跳过了懒狗。语言模型逐个生成词元，服务器把它们还原成文字。
素早い茶色の狐がのろまな犬を飛び越える。こんにちは、世界。
빠른 갈색 여우가 게으른 개를 뛰어넘는다. 안녕하세요.
الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم.
Η γρήγορη καφέ αλεπού πηδά πάνω από τον τεμπέλη σκύλο.
तेज़ भूरी लोमड़ी आलसी कुत्ते के ऊपर कूदती है।
def add(a: int, b: int) -> int:\n    return a + b  # 1 + 2 == 3, 0.5 * 4 = 2.0
{"role": "user", "content": "Hello! 👋 How are you? 🙂🚀"} <tag attr='x'>text</tag>
"""

_PRESETS: dict[str, dict[str, Any]] = {
    # ~4.5M parameters: the engine's default test/benchmark model.
    "tiny": dict(
        hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=768, vocab_size=2560, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, torch_dtype="float32",
    ),
    # The SmolLM2-135M shape (random weights).
    "smollm2-135m": dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, torch_dtype="bfloat16",
        tie_word_embeddings=True,
    ),
}  # fmt: skip

_ARCHS: dict[str, dict[str, Any]] = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                  attention_bias=False, mlp_bias=False),
    "smollm": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                   attention_bias=False, mlp_bias=False, tie_word_embeddings=True),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  use_sliding_window=False, sliding_window=None),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3",
                  attention_bias=False, use_sliding_window=False, sliding_window=None),
    # NOTE: hidden_activation, not hidden_act, is what Gemma 3 reads
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                   hidden_activation="gelu_pytorch_tanh", rope_theta=1_000_000.0,
                   rope_local_base_freq=10000.0, sliding_window=8, query_pre_attn_scalar=64,
                   tie_word_embeddings=True, attention_bias=False),
    # NOTE: pad_token_id inside the vocabulary (transformers' default 32000 is an Embedding
    # padding_idx); rope_scaling / partial_rotary_factor come as overrides
    "phi3": dict(architectures=["Phi3ForCausalLM"], model_type="phi3", pad_token_id=0,
                 sliding_window=None),
}  # fmt: skip


def _hf_config(
    arch: str, preset: str, vocab_size: int | None, overrides: dict[str, Any]
) -> dict[str, Any]:
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(_ARCHS)}")
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(_PRESETS)}")
    d: dict[str, Any] = {"tie_word_embeddings": False, "hidden_act": "silu"}
    d.update(_PRESETS[preset])
    d.update(_ARCHS[arch])
    if arch in ("qwen3", "gemma3"):
        # NOTE: Qwen3 states head_dim explicitly and it need not be hidden/heads.
        d["head_dim"] = 2 * d["hidden_size"] // d["num_attention_heads"]
    if vocab_size is not None:
        d["vocab_size"] = vocab_size
    d.update(overrides)
    d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    d.update(bos_token_id=0, eos_token_id=0)
    return d


def _random_weights(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in hf_tensor_shapes(cfg).items():
        if name.endswith("norm.weight"):
            # NOTE: applied as offset + w (Gemma's HF norms: offset 1): around 1 either way
            t = 1.0 - cfg.norm_weight_offset + 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # biases
            t = 0.1 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / shape[1] ** 0.5
        out[name] = t.to(dtype).contiguous()
    return out


def build_bpe_tokenizer_json(vocab_size: int, specials: tuple[str, ...] = SPECIAL_TOKENS) -> str:
    """A byte-level BPE with exactly ``vocab_size`` ids (specials first), as tokenizer.json text.

    Trained on the built-in text; if that yields fewer tokens, two-byte tokens (with their
    merges, lowest priority) fill the rest so every id in ``[0, vocab_size)`` decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(specials):
        raise ValueError(f"vocab_size must be >= {256 + len(specials)} for a byte-level BPE")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(_TRAIN_TEXT.splitlines(), trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[Any] = data["model"]["merges"]
    pairs = ((a, b) for a in alphabet for b in alphabet)
    while len(vocab) < vocab_size:
        a, b = next(pairs)
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
            merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
    return json.dumps(data, ensure_ascii=False)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _install_tokenizer(out: Path, tokenizer_json: str | None, vocab_size: int | None) -> int:
    """Write ``out/tokenizer.json``; return the model vocab size to use."""
    from tokenizers import Tokenizer

    target = out / "tokenizer.json"
    if tokenizer_json is None:
        size = vocab_size if vocab_size is not None else 0
        target.write_text(build_bpe_tokenizer_json(size, SPECIAL_TOKENS), encoding="utf-8")
        return size
    shutil.copyfile(tokenizer_json, target)
    tok = Tokenizer.from_file(str(target))
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise ValueError(f"{tokenizer_json}: {special!r} must exist with id {i}")
    n = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and vocab_size < n:
        raise ValueError(f"vocab_size {vocab_size} < tokenizer size {n}")
    return vocab_size if vocab_size is not None else n


def make_random_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "llama",
    preset: str = "tiny",
    vocab_size: int | None = None,
    seed: int = 0,
    tokenizer_json: str | None = None,
    **overrides: Any,
) -> Path:
    """Write a random-weight checkpoint of ``arch`` ("llama", "smollm", "mistral", "qwen2",
    "qwen3", "gemma3", "phi3") shaped by ``preset``; ``overrides`` set HF config keys (e.g. ``rope_scaling``).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_json is None and vocab_size is None:
        vocab_size = int(overrides.pop("vocab_size", _PRESETS[preset]["vocab_size"]))
    vocab = _install_tokenizer(out, tokenizer_json, vocab_size)
    hf = _hf_config(arch, preset, vocab, overrides)
    cfg = ModelConfig.from_hf_dict(hf)
    _write_json(out / "config.json", hf)
    save_file(
        _random_weights(cfg, seed, torch_dtype(cfg.torch_dtype)),
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    _write_json(out / "generation_config.json", {"bos_token_id": 0, "eos_token_id": [0, 2]})
    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": SPECIAL_TOKENS[0],
            "eos_token": SPECIAL_TOKENS[0],
            "pad_token": SPECIAL_TOKENS[0],
            "unk_token": None,
            "add_bos_token": False,
            "model_max_length": cfg.max_position_embeddings,
            "chat_template": CHATML_TEMPLATE,
        },
    )
    return out
