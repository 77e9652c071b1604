"""An HF folder whose ``config.json`` is damaged is refused with a ModelLoadError naming the
file, which the CLI prints as one line with exit 2 (module docstring of ``coda/cli.py``): a
JSON array was an AttributeError traceback, a missing field a KeyError, a null one a
TypeError (the CLI/API acceptance sweep)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from coda.models.config import ModelConfig, ModelLoadError

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "num_hidden_layers": 1, "num_attention_heads": 4, "intermediate_size": 128,
         "vocab_size": 100}


@pytest.mark.parametrize("text", [
    "{", "[1, 2]", "null",
    json.dumps({k: v for k, v in LLAMA.items() if k != "num_attention_heads"}),
    json.dumps({**LLAMA, "num_attention_heads": None}),
], ids=["not-json", "array", "null", "missing-field", "null-field"])
def test_a_damaged_config_is_a_load_error_naming_the_file(tmp_path: Path, text: str) -> None:
    (tmp_path / "config.json").write_text(text, encoding="utf-8")
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig.from_dir(tmp_path)


def test_a_sound_config_still_reads(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA), encoding="utf-8")
    assert ModelConfig.from_dir(tmp_path).num_heads == 4


@pytest.mark.parametrize(("name", "content"), [
    ("tokenizer.json", "{"),
    ("tokenizer_config.json", "nope"),
    ("generation_config.json", "["),
    ("model.safetensors", "x" * 100),
    ("model.safetensors", None),
], ids=["tokenizer", "tokenizer_config", "generation_config", "safetensors", "no-safetensors"])
def test_a_damaged_folder_file_is_a_load_error_naming_it(tmp_path: Path, name: str,
                                                         content: str | None) -> None:
    """Each file of an HF folder the load reads: damaged (or the weights missing), the load
    refuses with a ModelLoadError naming it; it was tokenizers' bare Exception, a
    SafetensorError, a FileNotFoundError (tracebacks in the CLI) or a JSON error naming no file."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.models.source import DEFAULT_MODEL_DIR

    folder = tmp_path / "m"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    if content is None:
        (folder / name).unlink()
    else:
        (folder / name).write_text(content, encoding="utf-8")
    with pytest.raises(ModelLoadError, match=re.escape(name if content else "safetensors")):
        AsyncEngine.from_model_dir(str(folder), EngineConfig())
