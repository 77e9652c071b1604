"""``coda generate --stop``: the stop strings' own rules (S1: non-empty, at most 16, each at most
256 UTF-8 bytes) need no model, so a bad ``--stop`` is a message and exit 2 before the model
loads (found by sweep 8: an empty ``--stop ""`` was refused only after the load), naming
``--stop`` once; a prompt that is no UTF-8 is refused before the load too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _generate(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda.cli", "generate", "Once upon a time",
                           "--max-tokens", "4", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("argv", [("--stop", ""), ("--stop", "x" * 257),
                                  tuple(a for i in range(17) for a in ("--stop", f"s{i}"))],
                         ids=["empty", "too-long", "seventeen"])
def test_s1_bad_stop_is_exit_2_before_the_load(argv: tuple[str, ...]) -> None:
    """S1, E1: a bad --stop names the stop, exits 2, and no model is loaded."""
    r = _generate(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "--stop" in r.stderr, r.stderr[-2000:]
    assert "loading model" not in r.stderr + r.stdout


def test_s1_sixteen_stops_of_256_bytes_are_served() -> None:
    """The bounds themselves are allowed (16 strings, 256 bytes each)."""
    stops = ["\u00e9" * 127 + f"{i:02x}" for i in range(16)]  # 254 + 2 = 256 bytes each
    assert all(len(s.encode()) == 256 for s in stops)
    r = _generate(*(a for s in stops for a in ("--stop", s)))
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.parametrize("stop", ["", "\udcff"], ids=["empty", "not-utf8"])
def test_s1_bad_stop_is_labelled_once(stop: str) -> None:
    """S1, E1: the refusal names ``--stop`` once: the engine's own ``stop:`` label (the HTTP
    APIs' wording) is not said after it (it read ``--stop: stop: stop strings must be ...``)."""
    r = _generate("--stop", stop)
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("error: invalid_request: --stop: "), line
    assert not line.removeprefix("error: invalid_request: --stop: ").startswith("stop:"), line


def test_e1_a_prompt_that_is_no_utf8_is_exit_2_before_the_load() -> None:
    """E1: argv bytes that are no UTF-8 (a lone surrogate in Python) are a message and exit 2
    before the model loads; they were the tokenizer's TypeError, a traceback and exit 1."""
    r = subprocess.run([sys.executable, "-m", "coda.cli", "generate", "ab\udcff",
                        "--max-tokens", "4"], cwd=ROOT, capture_output=True, text=True,
                       errors="surrogateescape", timeout=300)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "UTF-8" in r.stderr, r.stderr[-2000:]
    assert "loading model" not in r.stderr
