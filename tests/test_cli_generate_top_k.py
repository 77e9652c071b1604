"""``coda generate --top-k`` (the HTTP APIs' ``top_k``, checked as they check it: SamplingParams).
Found by the sweep: serve's protocols took top_k, ``coda generate`` had no such flag."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda.cli", "generate", "Once upon a time",
                           "--max-tokens", "12", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("value", ["-2", "-100"])
def test_e1_generate_top_k_below_minus_one_is_exit_2_before_the_load(value: str) -> None:
    """E1: as the protocols' 400: a message naming top_k, exit 2, no model loaded."""
    r = _generate("--top-k", value)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "top_k" in r.stderr, r.stderr[-2000:]
    assert "loading model" not in r.stderr + r.stdout


def test_generate_top_k_1_is_greedy_whatever_the_temperature() -> None:
    """``--top-k 1`` keeps one token: a hot sampled run gives the greedy text; ``--top-k 0``
    (off) with the same seed samples another."""
    greedy = _generate("--temperature", "0")
    top1 = _generate("--top-k", "1", "--temperature", "1.5", "--seed", "7")
    off = _generate("--top-k", "0", "--temperature", "1.5", "--seed", "7")
    for r in (greedy, top1, off):
        assert r.returncode == 0, r.stderr[-2000:]
    assert top1.stdout == greedy.stdout and off.stdout != greedy.stdout
