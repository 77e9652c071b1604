"""What the user named that cannot be used is a failure that names it (the CLI's side of SPEC
E1 and O1; found by an acceptance sweep): an empty trace is said to be empty (a replica that
served no request writes one: it holds every invariant) and a missing one is exit 2, a model
path that cannot be read makes ``coda models`` exit nonzero, and a missing ``--draft-model``
is said as the draft's failure (it read "cannot load model (default)"), and an empty ``--model``
is refused, not read as the working folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from coda.models import kernels

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "coda" / "assets" / "default_model"


def _coda(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank-lines"])
def test_o1_trace_check_of_an_empty_trace_says_it_is_empty(tmp_path: Path, content: str) -> None:
    """O1: no rows, no broken invariant (exit 0), but the line says the trace is empty and
    names it, never the "N request(s) ... every invariant holds" of a trace that had rows."""
    path = tmp_path / "t.jsonl"
    path.write_text(content, encoding="utf-8")
    r = _coda("trace", "check", str(path))
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr[-2000:])
    assert r.stdout.strip() == f"ok: the trace is empty (0 requests): {path}", r.stdout
    assert "Traceback" not in r.stderr


def test_o1_trace_check_of_a_missing_trace_is_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "none.jsonl"
    r = _coda("trace", "check", str(path))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "ok:" not in r.stdout and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and str(path) in r.stderr, r.stderr


def test_models_with_an_unreadable_named_model_is_exit_2_after_the_table() -> None:
    r = _coda("models", "/nonexistent.gguf", str(DEFAULT_MODEL))  # NOTE: the bad one first
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    # NOTE: its row is in the table, its reason on a line of its own below it: a long reason in
    # a cell squeezed every other column (tests/test_quant_modes.py's modes order broke)
    table, below = r.stdout.split("└", 1)
    assert "/nonexistent.gguf" in table and "not read" in table
    assert any(line.startswith("/nonexistent.gguf: ") for line in below.splitlines()), below
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "/nonexistent.gguf" in lines[0] and str(DEFAULT_MODEL) not in lines[0]


def test_models_with_readable_named_models_is_exit_0() -> None:
    r = _coda("models", str(DEFAULT_MODEL))
    assert r.returncode == 0 and "error" not in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(kernels.unavailable() is not None,
                    reason="speculative decoding needs a batch-invariant mode (native kernels)")
def test_missing_draft_model_names_the_draft_and_its_flag() -> None:
    r = _coda("serve", "--port", "0", "--draft-model", "/nonexistent/draft.gguf", timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "draft model /nonexistent/draft.gguf (--draft-model)" in last, last
    assert "cannot load model (default)" not in r.stderr and "Traceback" not in r.stderr


def test_python_api_draft_failure_is_a_draft_model_load_error() -> None:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.models.load_errors import DraftModelLoadError

    if kernels.unavailable() is not None:
        pytest.skip("speculative decoding needs a batch-invariant mode (native kernels)")
    with pytest.raises(DraftModelLoadError, match="/nonexistent/draft.gguf"):
        AsyncEngine.from_model_dir(None, EngineConfig(draft_model="/nonexistent/draft.gguf"))


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_e1_a_model_path_with_nothing_there_says_so(tmp_path: Path, command: str) -> None:
    """E1 (CLI): ``--model`` spelled as a path where nothing exists (a ``.gguf`` name, a path
    in a folder) is exit 2 with one line saying no such file or folder is there and where it
    looked; it read "not a folder, not a .gguf file and not an installed package", wrong for a
    name ending ``.gguf``. A bare name keeps the package wording."""
    missing = tmp_path / "sub" / "model.gguf"
    argv = {"generate": ["generate", "hi", "--max-tokens", "2"],
            "serve": ["serve", "--port", "18349"], "bench": ["bench", "-n", "1"]}[command]
    r = _coda(*argv, "--model", str(missing))
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert f"no such file or folder ({missing})" in last and "not a .gguf file" not in last, last
    assert "Traceback" not in r.stderr
    bare = _coda("generate", "hi", "--model", "no_such_model_package_here")
    assert bare.returncode == 2 and "not an installed package" in bare.stderr, bare.stderr


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_e1_an_empty_model_is_refused_not_read_as_the_working_folder(
        tmp_path: Path, smollm_gguf: Path, command: str) -> None:
    """E1 (CLI): ``--model ""`` (an unset ``--model "$MODEL"``) is exit 2 naming ``--model``
    before any load; ``Path("")`` is ".", so it loaded whatever single .gguf the working folder
    held (here one), or said "cannot load model (default): . has no config.json"."""
    import os

    (tmp_path / "other.gguf").symlink_to(smollm_gguf)
    argv = {"generate": ["generate", "hi", "--max-tokens", "2"],
            "serve": ["serve", "--port", "8734"]}[command]
    r = subprocess.run([sys.executable, "-m", "coda.cli", *argv, "--model", ""], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    last = r.stderr.strip().splitlines()[-1]
    assert "--model is empty" in last and "Traceback" not in r.stderr, last
    assert "other" not in r.stderr


def test_python_api_empty_model_is_a_model_load_error(tmp_path: Path) -> None:
    """The Python API's side: ``from_model_dir("")`` is a ModelLoadError saying the model is
    empty, never the working folder read as a model."""
    from coda.models.config import ModelLoadError
    from coda.models.source import resolve_model

    for spec in ("", "  "):
        with pytest.raises(ModelLoadError, match="the model is empty"):
            resolve_model(spec)
