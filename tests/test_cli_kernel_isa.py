"""``CODA_KERNEL_ISA`` naming no kernel build this CPU runs is the user's error (SPEC T4's
override; the CLI's side of SPEC E1): one line naming the builds it runs and exit 2 before any
work, from every command that loads or lists models, and :class:`KernelIsaError` from the
Python API. It was a silent fallback to the torch path: another serving mode, other output,
exit 0, and only a note in the load summary. Empty keeps meaning "the best build"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from coda.models import kernels

if (_why := kernels.unavailable()) is not None:  # NOTE: the builds can only be named when built
    pytest.skip(f"native kernels unavailable: {_why}", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent


def _coda(isa: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, kernels.ISA_ENV: isa}
    return subprocess.run([sys.executable, "-m", "coda.cli", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv", [
    ["generate", "hi", "--max-tokens", "1", "--seed", "1"],
    ["bench", "-n", "1", "--max-tokens", "1"],
    ["models"],
    ["serve", "--port", "0"],
], ids=lambda a: a[0])
def test_t4_unknown_isa_is_one_line_and_exit_2_before_any_work(argv: list[str]) -> None:
    try:  # NOTE: unchecked, `serve` loads and serves: a hang is a failure too
        r = _coda("avx9000", *argv)
    except subprocess.TimeoutExpired:
        pytest.fail(f"coda {' '.join(argv)} did not refuse CODA_KERNEL_ISA=avx9000")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "CODA_KERNEL_ISA=avx9000" in lines[0], r.stderr[-2000:]
    assert all(isa in lines[0] for isa in kernels.native().isas()), lines[0]
    assert r.stdout == ""  # NOTE: no table, no output: refused before any work


def test_t4_isa_this_cpu_cannot_run_is_exit_2() -> None:
    missing = sorted({"avx2", "avx512"} - set(kernels.native().isas()))
    if not missing:
        pytest.skip("this CPU runs every kernel build")
    r = _coda(missing[0], "generate", "hi", "--max-tokens", "1")
    assert r.returncode == 2 and "cannot run" in r.stderr, (r.returncode, r.stderr[-2000:])


def test_t4_empty_isa_is_the_best_build() -> None:
    r = _coda("", "generate", "hi", "--max-tokens", "1", "--seed", "1", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "native unavailable" not in r.stderr, r.stderr[-2000:]


def test_t4_python_api_raises_kernel_isa_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The typed error from the API, before the load (not a fallback engine)."""
    from coda.engine.async_engine import AsyncEngine

    monkeypatch.setenv(kernels.ISA_ENV, "avx9000")
    kernels.native.cache_clear()  # NOTE: the override is read once per process, at first use
    try:
        with pytest.raises(kernels.KernelIsaError, match="avx9000.*scalar"):
            AsyncEngine.from_model_dir(None)
    finally:
        monkeypatch.undo()  # NOTE: the environment first, so the next use applies the real one
        kernels.native.cache_clear()
