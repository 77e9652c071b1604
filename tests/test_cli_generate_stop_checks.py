"""``coda generate --stop``: the stop strings' own rules (S1: non-empty, at most 16, each at most
256 UTF-8 bytes) need no model, so a bad ``--stop`` is a message and exit 2 before the model
loads (found by sweep 8: an empty ``--stop ""`` was refused only after the load)."""

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
