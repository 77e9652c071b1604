"""``--max-model-len`` past the model's own context is capped and said (SPEC E1).

One flag serves every model of a several-model server, so a length above a model's own is
capped to it, not refused (vLLM refuses it at start); before, the cap was silent (100000 on
SmolLM2 served 8192 with no line saying so). Now a warning at load names both numbers, and
the load summary (its human lines and its JSON record) shows the context served and what was
asked: through the documented Python API and ``coda generate``.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig

MODEL_CONTEXT = 512  # NOTE: tests/conftest.py's server_checkpoint


def test_a_max_model_len_past_the_model_is_capped_with_a_warning_e1(
        server_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    """E1: ``max_model_len=100000`` on a 512-token model serves 512; the load warns naming
    both, ``describe()`` says it beside the context, ``load_summary()`` records it."""
    with caplog.at_level(logging.WARNING, logger="coda.engine"):
        engine = AsyncEngine.from_model_dir(server_checkpoint,
                                            EngineConfig(max_model_len=100000, num_blocks=64))
    assert engine.context_length == MODEL_CONTEXT
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("100000" in m and str(MODEL_CONTEXT) in m for m in warned), warned
    line = next(x for x in engine.describe() if "context" in x and "parameters" in x)
    assert f"context {MODEL_CONTEXT} (--max-model-len 100000 capped" in line, line
    summary = engine.load_summary()
    assert summary["context"] == MODEL_CONTEXT and summary["context_capped_from"] == 100000


def test_a_max_model_len_within_the_model_is_served_without_a_warning_e1(
        server_checkpoint: Path, caplog: pytest.LogCaptureFixture) -> None:
    """E1: a length at or below the model's own is served as asked, nothing said."""
    with caplog.at_level(logging.WARNING, logger="coda.engine"):
        engine = AsyncEngine.from_model_dir(server_checkpoint,
                                            EngineConfig(max_model_len=256, num_blocks=64))
    assert engine.context_length == 256 and engine.context_capped_from is None
    assert not [r for r in caplog.records if "max-model-len" in r.getMessage()]
    assert "context_capped_from" not in engine.load_summary()


def test_coda_generate_says_the_cap_on_stderr_e1(server_checkpoint: Path) -> None:
    """E1: ``coda generate --max-model-len 100000`` on a 512-token model runs, and its
    stderr names both numbers (the warning and the load summary's context line)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-m", "coda.cli", "generate", "hi", "--model",
                          str(server_checkpoint), "--max-model-len", "100000",
                          "--max-tokens", "1", "--kv-cache-bytes", str(8 * 2**20)],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert f"--max-model-len 100000 is more than the model's context of {MODEL_CONTEXT}" \
        in out.stderr, out.stderr
    assert f"context {MODEL_CONTEXT} (--max-model-len 100000 capped" in out.stderr
