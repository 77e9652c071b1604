"""Ctrl-C (or SIGTERM) while `coda generate` / `coda serve` loads the model ends the process
at once with one line saying so and exit 128 + the signal (SPEC L7: nothing is left running;
C1: the interruption is said, never silent). Before, the KeyboardInterrupt was silent (typer
turns it into exit 130 without a word), came seconds late where the load was in native code,
and, when it landed as the load's worker threads were in native code, the interpreter's exit
aborted the process ("terminate called without an active exception", SIGABRT)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scaleout_support import free_port

ROOT = Path(__file__).resolve().parent.parent


def _default_sigint() -> None:
    # NOTE: as in a terminal: a runner started in the background ignores SIGINT, and a child
    # inherits that (the signal would never arrive)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_at_load(argv: list[str], sig: signal.Signals) -> tuple[int, str, float]:
    """Start ``coda argv``, send ``sig`` as soon as it says the load started, and return its
    exit status, its stderr and the seconds it took to end after the signal."""
    proc = subprocess.Popen([sys.executable, "-m", "coda", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=_default_sigint)
    assert proc.stderr is not None
    try:
        seen = b""
        while b"loading model" not in seen:
            line = proc.stderr.readline()
            assert line, f"exited before the load: {seen.decode()[-2000:]}"
            seen += line
        proc.send_signal(sig)
        sent = time.monotonic()
        _, rest = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    return proc.returncode, (seen + rest).decode(), took


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_l7_c1_a_signal_during_generates_load_ends_it_with_a_line(
        smollm_gguf: Path, sig: signal.Signals) -> None:
    rc, err, took = _interrupt_at_load(["generate", "Once upon a time", "--model",
                                        str(smollm_gguf), "--max-tokens", "4"], sig)
    assert rc == 128 + int(sig), (rc, err[-2000:])
    assert f"interrupted ({sig.name}) before the request started" in err, err[-2000:]
    assert "Traceback" not in err and "terminate called" not in err, err[-2000:]
    assert "[FINISHED" not in err and took < 5, (took, err[-2000:])


def test_l7_c1_sigint_during_serves_load_ends_it_with_a_log_line(smollm_gguf: Path) -> None:
    rc, err, took = _interrupt_at_load(["serve", "--model", str(smollm_gguf), "--port",
                                        str(free_port())], signal.SIGINT)
    assert rc == 130, (rc, err[-2000:])
    last = err.strip().splitlines()[-1]
    assert '"level": "WARNING"' in last and "interrupted (SIGINT) while loading the model" in last
    assert "Traceback" not in err and "terminate called" not in err and took < 5


def test_l7_c1_sigint_during_benchs_load_ends_it_with_a_line(smollm_gguf: Path) -> None:
    """``coda bench`` as generate and serve: it was a KeyboardInterrupt traceback."""
    rc, err, took = _interrupt_at_load(["bench", "--model", str(smollm_gguf), "-n", "1",
                                        "--concurrency", "1", "--max-tokens", "2"],
                                       signal.SIGINT)
    assert rc == 130, (rc, err[-2000:])
    assert "interrupted (SIGINT) while loading the model" in err, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert "terminate called" not in err and took < 5, (took, err[-2000:])
