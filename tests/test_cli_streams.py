"""What each command writes where: its output on stdout, what was loaded (and progress,
timings) on stderr, so that `coda generate ... > out.txt` holds the completion only and
`coda bench > report.txt` the report only (the CLI/API acceptance sweep: bench printed the
load summary on stdout)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
