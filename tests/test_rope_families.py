"""Llama with RoPE scaling from a GGUF (issue 19 item 1; SPEC T3): ``llama3`` stored as
``rope_freqs.weight``, ``linear`` and ``yarn`` from ``llama.rope.scaling.*``.

Each case is a tiny random HF folder whose transformers (eager) logits are the oracle, and a
GGUF holding the same weights as llama.cpp's converter writes them (q/k rows permuted, the
scaling in the file's own terms): Coda gives the folder's logits from either, within 1e-4,
and the same file without its scaling gives other logits (so the comparison can fail). The
``rope_freqs`` divisors are computed here as the converter does, not by Coda. transformers'
own GGUF loader is no oracle: it drops ``rope_freqs.weight``."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from coda.engine.runner import ModelRunner
from coda.models.config import ModelConfig, UnsupportedModelError
from coda.models.gguf_file import open_gguf
from coda.models.gguf_weights import load_gguf_model
from coda.models.loader import load_model
from coda.models.rope import inv_freq
from coda.models.tokenizer_bundle import bundle_from_gguf
from tests.family_fixtures import chat_through_both_sdks, folder_to_gguf, greedy_steps
from tests.random_checkpoint import (
    SPECIAL_TOKENS,
    build_bpe_tokenizer_json,
    make_random_checkpoint,
)
from tests.test_models import full_forward, hf_logits

SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                             max_position_embeddings=256)
PROMPT = [(i * 53 + 7) % 300 + 10 for i in range(48)]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
YARN_BETAS = {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3}
Writer = Callable[[gguf.GGUFWriter], None]


def coda_divisors(cfg: ModelConfig) -> list[float]:
    """The config's scaling as per-frequency divisors (what llama.cpp's converter stores in
    ``rope_freqs.weight``): the unscaled frequencies over Coda's scaled ones."""
    unscaled = inv_freq(dataclasses.replace(cfg, rope_scaling=None))
    return [float(x) for x in (unscaled / inv_freq(cfg)).tolist()]


def converter_divisors(theta: float, dim: int, rs: dict[str, Any]) -> list[float]:
    """``rope_freqs.weight`` as llama.cpp's converter computes it for Llama 3 scaling."""
    factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
    old = rs["original_max_position_embeddings"]
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def _yarn_kv(rs: dict[str, Any]) -> Writer:
    def kv(w: gguf.GGUFWriter) -> None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rs["factor"])
        w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
        if "attention_factor" in rs:
            w.add_rope_scaling_yarn_attn_factor(rs["attention_factor"])
        if "beta_fast" in rs:
            w.add_rope_scaling_yarn_beta_fast(rs["beta_fast"])
            w.add_rope_scaling_yarn_beta_slow(rs["beta_slow"])
    return kv


def _linear_kv(w: gguf.GGUFWriter) -> None:
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(4.0)


CASES: dict[str, dict[str, Any]] = {
    "llama3": {"rope_scaling": LLAMA3, "rope_theta": 500000.0},
    "linear": {"rope_scaling": {"type": "linear", "factor": 4.0}},
    "yarn": {"rope_scaling": YARN},
    "yarn-betas": {"rope_scaling": YARN_BETAS},
}


LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>")
# NOTE: Llama 3's turn format, written for this test (the llama3 folder carries it)
LLAMA3_TEMPLATE = ("{{ '<|begin_of_text|>' }}{% for m in messages %}{{ '<|start_header_id|>' + "
                   "m['role'] + '<|end_header_id|>\n\n' + m['content'] + '<|eot_id|>' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant"
                   "<|end_header_id|>\n\n' }}{% endif %}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One folder per case; the llama3 one with Llama 3's special tokens and turn format."""
    root = tmp_path_factory.mktemp("rope")
    tok = root / "llama3-tokenizer.json"
    tok.write_text(build_bpe_tokenizer_json(SHAPE["vocab_size"],
                                            SPECIAL_TOKENS + LLAMA3_SPECIALS), encoding="utf-8")
    out = {name: make_random_checkpoint(
        root / name, arch="llama", seed=11 + i,
        tokenizer_json=str(tok) if name == "llama3" else None, **{**SHAPE, **extra})
        for i, (name, extra) in enumerate(CASES.items())}
    (out["llama3"] / "chat_template.jinja").write_text(LLAMA3_TEMPLATE, encoding="utf-8")
    return out


def _file(case: str, folder: Path, path: Path, scaled: bool = True) -> Path:
    """The folder as a GGUF whose RoPE scaling is stated as llama.cpp stores it (none when
    ``scaled`` is False)."""
    if not scaled:
        return folder_to_gguf(folder, path, "llama")
    if case == "llama3":
        cfg = ModelConfig.from_dir(folder)
        divisors = converter_divisors(cfg.rope_theta, cfg.head_dim, LLAMA3)
        return folder_to_gguf(folder, path, "llama",
                              tensors={"rope_freqs.weight": torch.tensor(divisors).numpy()})
    kv = _linear_kv if case == "linear" else _yarn_kv(CASES[case]["rope_scaling"])
    return folder_to_gguf(folder, path, "llama", kv=kv)


@pytest.mark.parametrize("case", list(CASES))
def test_t3_llama_rope_scaling_gguf_gives_the_folders_logits(
        case: str, folders: dict[str, Path], tmp_path: Path) -> None:
    """T3: the folder (transformers' logits) and its GGUF (the scaling as llama.cpp stores
    it) give Coda the same logits within 1e-4; the file without its scaling does not."""
    folder = folders[case]
    ref = hf_logits(folder, PROMPT, torch.float32)
    assert ref.std() > 0.3
    assert (full_forward(load_model(folder), PROMPT) - ref).abs().max().item() <= 1e-4
    from_file = load_gguf_model(_file(case, folder, tmp_path / "scaled.gguf"))
    assert (full_forward(from_file, PROMPT) - ref).abs().max().item() <= 1e-4
    plain = load_gguf_model(_file(case, folder, tmp_path / "plain.gguf", scaled=False))
    assert (full_forward(plain, PROMPT) - ref).abs().max().item() > 1e-3


def test_t3_llama3_rope_freqs_config_and_divisors(folders: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """A ``rope_freqs.weight`` file is Llama 3 scaling as per-frequency divisors (read into the
    config, not the weights); Coda's one llama3 implementation and the converter's divisors
    give the same frequencies; a llama3 folder's context is its max_position_embeddings."""
    folder = folders["llama3"]
    cfg = ModelConfig.from_dir(folder)
    ckpt = open_gguf(_file("llama3", folder, tmp_path / "l3.gguf"))
    rs = ckpt.config.rope_scaling
    assert rs is not None and rs.kind == "freq_factors"
    assert cfg.rope_scaling is not None
    assert rs.short_factor == pytest.approx(converter_divisors(5e5, 16, LLAMA3), rel=1e-6)
    assert coda_divisors(cfg) == pytest.approx(rs.short_factor, rel=1e-5)
    assert 1.0 in rs.short_factor and 8.0 in rs.short_factor  # NOTE: both ends are exercised
    torch.testing.assert_close(inv_freq(ckpt.config), inv_freq(cfg), rtol=1e-6, atol=0)
    assert "rope_freqs.weight" not in {t.gguf_name for t in ckpt.tensors()}
    assert ckpt.config.max_context == cfg.max_context == 256


def test_t3_yarn_config_from_folder_and_file_agree(folders: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """yarn's numbers (factor, original context, betas, attention factor: transformers'
    0.1 ln(s) + 1 when the config has none) are the same from the folder and the file."""
    for case in ("yarn", "yarn-betas"):
        a = ModelConfig.from_dir(folders[case]).rope_scaling
        b = open_gguf(_file(case, folders[case], tmp_path / f"{case}.gguf")).config.rope_scaling
        assert a is not None and b is not None
        assert (a.kind, a.factor, a.original_max_position_embeddings, a.beta_fast,
                a.beta_slow) == (b.kind, b.factor, b.original_max_position_embeddings,
                                 b.beta_fast, b.beta_slow)
        assert a.attention_factor == pytest.approx(b.attention_factor, rel=1e-6)
    plain = ModelConfig.from_dir(folders["yarn"]).rope_scaling
    assert plain is not None and plain.attention_factor == pytest.approx(0.1 * math.log(4) + 1)


def test_t3_yarn_decode_through_the_paged_cache_equals_transformers(
        folders: dict[str, Path], tmp_path: Path) -> None:
    """Greedy decoding from the yarn GGUF through the runner (prefill, then one token a step,
    RoPE tables growing): each step's logits within 1e-4 of transformers' on the folder."""
    runner = ModelRunner(load_gguf_model(_file("yarn-betas", folders["yarn-betas"],
                                               tmp_path / "y.gguf")),
                         num_blocks=8, block_size=16)
    tokens, logits = greedy_steps(runner, PROMPT, 10)
    ref = hf_logits(folders["yarn-betas"], PROMPT + tokens, torch.float32)[len(PROMPT) - 1: -1]
    assert (logits - ref).abs().max().item() <= 1e-4


def test_rope_scaling_the_file_cannot_state_is_refused(folders: dict[str, Path],
                                                       tmp_path: Path) -> None:
    """A yarn file with llama.cpp-only knobs transformers has no meaning for, or LongRoPE
    factors on a llama3 file, is refused at open, naming what."""
    def ext(w: gguf.GGUFWriter) -> None:
        _yarn_kv(YARN)(w)
        w.add_rope_scaling_yarn_ext_factor(0.5)

    with pytest.raises(UnsupportedModelError, match="ext_factor"):
        open_gguf(folder_to_gguf(folders["yarn"], tmp_path / "ext.gguf", "llama", kv=ext))
    bad = {"rope_freqs.weight": torch.ones(8).numpy(), "rope_factors_long.weight":
           torch.ones(8).numpy()}
    with pytest.raises(UnsupportedModelError, match="rope_factors"):
        open_gguf(folder_to_gguf(folders["llama3"], tmp_path / "mix.gguf", "llama",
                                 tensors=bad))
    wrong = {"rope_freqs.weight": torch.ones(5).numpy()}
    with pytest.raises(UnsupportedModelError, match="needs 8"):
        open_gguf(folder_to_gguf(folders["llama3"], tmp_path / "len.gguf", "llama",
                                 tensors=wrong))


def test_k2_llama3_gguf_chat_from_the_files_template_through_both_sdks(
        folders: dict[str, Path], tmp_path: Path) -> None:
    """A chat on the tiny rope_freqs Llama 3 GGUF over loopback: the prompt is the file's own
    turn format, ``<|eot_id|>`` ends a turn, and the official openai and anthropic clients
    get the same greedy reply."""
    path = _file("llama3", folders["llama3"], tmp_path / "chat.gguf")
    bundle = bundle_from_gguf(open_gguf(path))
    eot = bundle.tokenizer.token_to_id("<|eot_id|>")
    assert bundle.chat_template == LLAMA3_TEMPLATE and eot in bundle.eos_token_ids
    messages: list[Any] = [{"role": "user", "content": "the quick brown fox"}]
    prompt, reply, message = chat_through_both_sdks(path, messages)
    assert prompt == ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n"
                      "the quick brown fox<|eot_id|><|start_header_id|>assistant"
                      "<|end_header_id|>\n\n")
    ids = bundle.tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids.count(eot) == 1 and reply.usage is not None
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].finish_reason in ("stop", "length")
    text = "".join(b.text for b in message.content if b.type == "text")
    assert text == reply.choices[0].message.content
