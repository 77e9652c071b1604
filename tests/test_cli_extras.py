"""A flag whose extra is not installed (issue 24 item 5): ``coda`` says which extra to install,
in one message, before any work (no port bound, no model loaded), exits 2 and prints no
traceback. Run as a real process with the module hidden (``sys.modules[name] = None`` makes
``import name`` fail as if it were not installed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# NOTE: the wrapper hides the modules, then runs the real entry point with the given argv
WRAPPER = ("import sys; hidden, argv = sys.argv[1].split(','), sys.argv[2:]\n"
           "for name in hidden: sys.modules[name] = None\n"
           "sys.argv = ['coda', *argv]\n"
           "from coda.cli import main; main()")

MISSING_MODEL = "/nonexistent/model"  # NOTE: a check after the load would say "cannot load"


def _coda(hidden: list[str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", WRAPPER, ",".join(hidden), *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("hidden", "argv", "extra", "names"), [
    (["redis"], ["serve", "--redis-url", "redis://127.0.0.1:1"], "durable", "--redis-url"),
    (["ray"], ["serve", "--replicas", "2"], "scale", "--replicas"),
    (["ray"], ["serve", "--replicas", "1", "--ray-address", "127.0.0.1:1"], "scale",
     "--ray-address"),
    (["ray", "redis"], ["serve", "--replicas", "2", "--redis-url", "redis://127.0.0.1:1"],
     "scale,durable", "--redis-url"),
    (["msgpack"], ["serve", "--redis-url", "redis://127.0.0.1:1"], "durable", "msgpack"),
    (["matplotlib"], ["bench", "--plot", "out.png", "-n", "1"], "plot", "--plot"),
])
def test_missing_extra_named_before_any_work_exit_2(hidden: list[str], argv: list[str],
                                                      extra: str, names: str) -> None:
    """One line naming the flag and ``pip install 'coda-llm[<extras>]'``; exit 2; no traceback;
    nothing started (no 'loading model', no load error for the missing model, no bind)."""
    proc = _coda(hidden, *argv, "--model", MISSING_MODEL)
    err = proc.stderr
    assert proc.returncode == 2, err
    assert f"pip install 'coda-llm[{extra}]'" in err
    assert names in err
    assert "Traceback" not in err and "ModuleNotFoundError" not in err
    assert "loading model" not in err and "cannot load model" not in err
    assert err.count("error:") == 1


def test_without_the_flag_nothing_optional_is_required() -> None:
    """Control: the same hidden modules do not matter when no flag needs them (the model load
    is reached and fails on the missing model: exit 2 with that message, not the extras')."""
    proc = _coda(["redis", "ray", "matplotlib"], "serve", "--model", MISSING_MODEL,
                 "--port", "0")
    assert proc.returncode == 2, proc.stderr
    assert "coda-llm[" not in proc.stderr
    assert "cannot load model" in proc.stderr or "/nonexistent/model" in proc.stderr
