"""``coda generate``'s token budget is the HTTP APIs' (SPEC L4; coda/engine/plan.py): without
``--max-tokens`` the request names no limit, so the engine's default (``EngineConfig.
default_max_tokens``) applies, or the context where it comes first (finish ``context_limit``);
with the flag, exactly that limit, refused past the context. It used to send 128 always, so a
prompt within 128 tokens of the context was refused though no limit was asked for."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from coda.engine.types import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Once upon a time there was a"  # NOTE: 9 tokens with the embedded model's BOS


def _generate(*argv: str) -> tuple[subprocess.CompletedProcess[str], dict[str, int]]:
    r = subprocess.run([sys.executable, "-m", "coda.cli", "generate", PROMPT, "--temperature",
                        "0", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    usage = [json.loads(line[len("usage: "):]) for line in r.stderr.splitlines()
             if line.startswith("usage: ")]
    return r, usage[0] if usage else {}


def test_l4_no_max_tokens_runs_to_a_small_context_as_http_does() -> None:
    r, usage = _generate("--max-model-len", "16")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "finish_reason=context_limit" in r.stderr and usage["selected_tokens"] == 16 - 9


def test_l4_no_max_tokens_is_the_engine_default_budget() -> None:
    default = EngineConfig().default_max_tokens
    r, usage = _generate("--max-model-len", str(default + 40))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "finish_reason=max_output_tokens" in r.stderr and usage["selected_tokens"] == default


def test_l4_explicit_max_tokens_is_kept_and_refused_past_the_context() -> None:
    r, usage = _generate("--max-model-len", "16", "--max-tokens", "3")
    assert r.returncode == 0 and usage["selected_tokens"] == 3, r.stderr[-2000:]
    assert "finish_reason=max_output_tokens" in r.stderr
    r, _ = _generate("--max-model-len", "16", "--max-tokens", "8")
    assert r.returncode == 2 and "max_tokens (8) exceeds the context (16)" in r.stderr, r.stderr


def test_help_says_the_default_budget() -> None:
    r = subprocess.run([sys.executable, "-m", "coda.cli", "generate", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "400", "TERMINAL_WIDTH": "400"})
    assert r.returncode == 0, r.stderr
    text = " ".join(re.sub(r"[\u2500-\u257f]", " ", r.stdout).split())  # NOTE: box and spaces
    assert f"the engine's default_max_tokens, {EngineConfig().default_max_tokens}," in text
    assert "finish_reason context_limit" in text
