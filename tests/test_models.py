"""Model code against the `transformers` reference (SPEC T3): every architecture, fp32 and bf16.

`transformers` is a test-only dependency, imported inside the tests.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from coda.models.attention import AttentionMetadata, PagedKVCache
from coda.models.config import ModelConfig, UnsupportedModelError
from coda.models.llama import CausalLM
from coda.models.loader import load_model
from tests.random_checkpoint import make_random_checkpoint

SMALL: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama3-rope-scaling": ("llama", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "llama-linear-rope-bias": (
        "llama",
        {
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {"sliding_window": 4096}),
    "smollm-tied": ("smollm", {}),
}
PROMPT = [5, 17, 3, 250, 99, 42, 7, 7, 300, 11, 64, 128, 1, 2, 200, 31, 8, 77, 150, 260, 4, 90]


def full_forward(model: CausalLM, ids: list[int], block_size: int = 4) -> torch.Tensor:
    """Logits [T, vocab] (float32) of one sequence's whole prompt in a single forward."""
    cfg = model.config
    n_blocks = (len(ids) + block_size - 1) // block_size
    kv = PagedKVCache(
        num_layers=cfg.num_layers,
        num_blocks=n_blocks,
        block_size=block_size,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=model.model.norm.weight.dtype,  # NOTE: packed embeddings have no weight
    )
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(n_blocks))], block_size)
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), meta.positions, meta, kv)
        return model.compute_logits(hidden).float()


_HF_CACHE: dict[tuple[Path, tuple[int, ...], torch.dtype], torch.Tensor] = {}


def hf_logits(model_dir: Path, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """The HF eager implementation's logits [T, vocab] (memoised per checkpoint)."""
    from transformers import AutoModelForCausalLM

    key = (model_dir, tuple(ids), dtype)
    if key in _HF_CACHE:
        return _HF_CACHE[key]

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    with torch.inference_mode():
        out = hf(torch.tensor([ids])).logits[0].float()
    _HF_CACHE[key] = out
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        name: make_random_checkpoint(root / name, arch=arch, seed=i, **{**SMALL, **extra})
        for i, (name, (arch, extra)) in enumerate(CASES.items())
    }


@pytest.mark.parametrize("case", list(CASES))
def test_t3_logits_match_transformers_fp32(case: str, checkpoints: dict[str, Path]) -> None:
    """Full-prompt logits equal the HF implementation for each architecture (fp32)."""
    ours = full_forward(load_model(checkpoints[case]), PROMPT)
    ref = hf_logits(checkpoints[case], PROMPT, torch.float32)
    assert ref.std() > 0.3  # NOTE: a non-trivial distribution, so the comparison can fail
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("case", ["llama", "qwen3", "smollm-tied"])
def test_t3_bf16_close_to_fp32_reference(case: str, checkpoints: dict[str, Path]) -> None:
    """bf16 runs: logits near the fp32 reference and (almost always) the same argmax."""
    ours = full_forward(load_model(checkpoints[case], dtype="bfloat16"), PROMPT)
    ref = hf_logits(checkpoints[case], PROMPT, torch.float32)
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.85


def test_llama3_scaling_changes_rope(checkpoints: dict[str, Path]) -> None:
    """The llama3 case really scales: ignoring rope_scaling would give other logits."""
    d = checkpoints["llama3-rope-scaling"]
    scaled = full_forward(load_model(d), PROMPT)
    hf = json.loads((d / "config.json").read_text())
    hf["rope_scaling"] = None
    model = load_model(d)
    unscaled_model = CausalLM(ModelConfig.from_hf_dict(hf))
    unscaled_model.load_state_dict(model.state_dict())
    assert (full_forward(unscaled_model, PROMPT) - scaled).abs().max() > 1e-3


def test_sharded_checkpoint_loads_same_weights(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints["qwen2"]
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map: dict[str, str] = {}
    for i, part in enumerate((names[::2], names[1::2])):
        fname = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, str(tmp_path / fname))
        weight_map.update({n: fname for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    a, b = load_model(src).state_dict(), load_model(tmp_path).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loader_rejects_missing_and_unexpected_tensors(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    src = checkpoints["llama"]
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    save_file(
        {k: v for k, v in tensors.items() if "q_proj" not in k}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ValueError, match="lacks tensors"):
        load_model(tmp_path)
    save_file(
        {**tensors, "model.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ValueError, match="unexpected tensor"):
        load_model(tmp_path)


def _hf(**kw: Any) -> dict[str, Any]:
    base = dict(
        architectures=["LlamaForCausalLM"], vocab_size=100, hidden_size=64, intermediate_size=96,
        num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
    )  # fmt: skip
    return {**base, **kw}


def test_t3_config_normalisation_and_kv_scalars() -> None:
    """T3: kv_scalars_per_token == 2·L·H_kv·d_h; quirks resolved per architecture."""
    cfg = ModelConfig.from_hf_dict(_hf(eos_token_id=[1, 2]))
    assert cfg.head_dim == 8 and cfg.kv_scalars_per_token == 2 * 3 * 2 * 8
    assert cfg.kv_bytes_per_token("bfloat16") == 2 * 3 * 2 * 8 * 2
    assert cfg.eos_token_ids == (1, 2) and not cfg.tie_word_embeddings
    qwen2 = ModelConfig.from_hf_dict(_hf(architectures=["Qwen2ForCausalLM"], sliding_window=32))
    assert qwen2.attention_bias and not qwen2.attention_out_bias and qwen2.sliding_window is None
    qwen3 = ModelConfig.from_hf_dict(_hf(architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and qwen3.q_size == 256
    mistral = ModelConfig.from_hf_dict(
        _hf(architectures=["MistralForCausalLM"], sliding_window=512, max_position_embeddings=4096)
    )
    assert mistral.max_context == 512  # NOTE: full attention is exact only up to the window
    v5 = ModelConfig.from_hf_dict(
        _hf(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0})
    )
    assert v5.rope_theta == 5e5 and v5.rope_scaling is not None and v5.rope_scaling.kind == "llama3"
    dyn = ModelConfig.from_hf_dict(
        _hf(rope_scaling={"type": "dynamic", "factor": 2.0}, max_position_embeddings=1024)
    )
    assert dyn.max_context == 1024


def test_unknown_rope_type_and_arch_are_rejected() -> None:
    # NOTE: yarn is supported since issue 19 (tests/test_rope_families.py); mrope is not
    with pytest.raises(UnsupportedModelError, match="rope scaling type 'mrope'"):
        ModelConfig.from_hf_dict(_hf(rope_scaling={"rope_type": "mrope", "factor": 4.0}))
    with pytest.raises(UnsupportedModelError, match="unsupported architectures"):
        ModelConfig.from_hf_dict(_hf(architectures=["GPT2LMHeadModel"]))


def test_random_checkpoint_tokenizer_covers_vocab(checkpoints: dict[str, Path]) -> None:
    """Every model id decodes (a random model samples all of them); specials at 0, 1, 2."""
    from tokenizers import Tokenizer

    d = checkpoints["llama"]
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    assert tok.get_vocab_size() == ModelConfig.from_dir(d).vocab_size == 320
    assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        0,
        1,
        2,
    ]
    text = "Hello, 世界! Привет 👋"
    assert tok.decode(tok.encode(text).ids) == text
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tc["chat_template"] and tc["eos_token"] == "<|endoftext|>"


def test_fused_rmsnorm_is_the_reference_formula_bit_for_bit() -> None:
    """The fp32 RMSNorm (one fused kernel) equals HF's three-step formula exactly, and a row's
    result does not depend on the other rows (T4)."""
    from coda.models.llama import RMSNorm

    norm = RMSNorm(576, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(576))
    x = torch.randn(70, 576) * 3
    ref = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    out = norm(x)
    assert torch.equal(out, ref)
    assert all(torch.equal(norm(x[:m]), out[:m]) for m in (1, 2, 5, 33))


def test_rope_table_chunks_are_independent_of_growth(checkpoints: dict[str, Path]) -> None:
    """T4: a position's cos/sin are the same bits whether the table was built up to it in one
    go or grown step by step (each chunk is computed by the same ops)."""
    model = load_model(checkpoints["llama"])
    pos = torch.tensor([0, 5, 1023, 1024, 2100])
    grown = [model._rope(pos[:i + 1], torch.float32, int(pos[i])) for i in range(len(pos))][-1]
    model._rope_table = None
    once = model._rope(pos, torch.float32, 2100)
    assert all(torch.equal(a, b) for a, b in zip(grown, once, strict=True))
    assert grown[0].shape == (5, 1, model.config.head_dim)
