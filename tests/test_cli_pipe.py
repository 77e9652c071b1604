"""`coda generate ... | head -c 20` ends quietly, as a Unix tool whose reader left (SPEC C1: the
request is cancelled, L7: the engine shuts down, nothing left running): exit 0, no traceback,
no "Exception ignored" at the interpreter's exit, no terminal line, and it ends at once rather
than generating the rest. Before, the write's BrokenPipeError reached click, which exited 1.

A stdout that cannot take the output (a full disk: /dev/full; a closed descriptor: ``>&-``)
is an error, said: one ``error:`` line naming stdout, the request cancelled and its end
reported (C1, L4), exit 1, no traceback. Before, it was a traceback (OSError; with fd 1
closed, AttributeError on ``sys.stdout``) and the request's end was never said."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_c1_l7_generate_into_a_closed_pipe_exits_0_quietly(smollm_gguf: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "coda", "generate", "Once upon a time",
                             "--model", str(smollm_gguf), "--max-tokens", "3000",
                             "--seed", "1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        head = proc.stdout.read(20)  # NOTE: what `head -c 20` does: read 20 bytes, then leave
        proc.stdout.close()
        closed = time.monotonic()
        _, err_bytes = proc.communicate(timeout=120)
        took = time.monotonic() - closed
    finally:
        proc.kill()
    err = err_bytes.decode()
    assert len(head) == 20
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    for noise in ("Traceback", "Exception ignored", "BrokenPipe", "terminate called",
                  "[FINISHED", "[CANCELLED"):
        assert noise not in err, err[-2000:]
    assert took < 30, (took, err[-2000:])  # NOTE: cancelled, not 3000 tokens generated


@pytest.mark.parametrize("where", ["/dev/full", "closed"])
def test_c1_l4_generate_into_an_unwritable_stdout_is_one_error_line_and_exit_1(
        smollm_gguf: Path, where: str) -> None:
    if where == "/dev/full" and not Path(where).exists():
        pytest.skip("no /dev/full here")
    argv = [sys.executable, "-m", "coda", "generate", "Once upon a time", "--model",
            str(smollm_gguf), "--max-tokens", "3000", "--seed", "1"]
    if where == "closed":  # NOTE: the shell's `>&-`: the child starts with fd 1 closed
        r = subprocess.run(argv, cwd=ROOT, stderr=subprocess.PIPE, timeout=120,
                           preexec_fn=lambda: os.close(1))
    else:
        with open(where, "wb") as full:
            r = subprocess.run(argv, cwd=ROOT, stdout=full, stderr=subprocess.PIPE, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 1, (r.returncode, err[-2000:])
    for noise in ("Traceback", "Exception ignored", "terminate called", "Task was destroyed"):
        assert noise not in err, err[-2000:]
    why = "No space left on device" if where == "/dev/full" else "stdout is closed"
    assert f"error: cannot write the output to stdout: {why}\n" in err, err[-2000:]
    assert "[CANCELLED · finish_reason=cancelled]" in err, err[-2000:]


def test_c1_models_into_a_closed_pipe_exits_0_quietly() -> None:
    """`coda models | head -1`: the reader leaves after one line; the command ends with exit 0
    and no traceback (before: BrokenPipeError, exit 1)."""
    proc = subprocess.Popen([sys.executable, "-m", "coda", "models"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    try:
        first = proc.stdout.readline()
        proc.stdout.close()
        _, err_bytes = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = err_bytes.decode()
    assert first
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]


def test_version_prints_the_installed_version_and_exits_0() -> None:
    """`coda --version`: one line naming the package version, exit 0, no model loaded."""
    from importlib.metadata import version

    r = subprocess.run([sys.executable, "-m", "coda", "--version"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"coda {version('coda-llm')}"


@pytest.mark.parametrize("trace", ["faultmix_trace.jsonl", "cut"])
def test_trace_check_into_a_full_stdout_is_one_error_line_and_exit_1(
        tmp_path: Path, trace: str) -> None:
    """`coda trace check FILE > /dev/full`: generate's one line ("cannot write the output to
    stdout") and exit 1, where it was a traceback (the same for `coda models`)."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    path = ROOT / "tests" / "data" / "faultmix_trace.jsonl"
    if trace == "cut":  # NOTE: a verdict of problems: printed first, so the write fails there
        text = path.read_text(encoding="utf-8")
        path = tmp_path / "cut.jsonl"
        path.write_text(text[:-40], encoding="utf-8")
    for argv in (["trace", "check", str(path)], ["models"]):
        with open("/dev/full", "wb") as full:
            r = subprocess.run([sys.executable, "-m", "coda", *argv], cwd=ROOT, stdout=full,
                               stderr=subprocess.PIPE, text=True, timeout=120)
        assert r.returncode == 1, (argv, r.returncode, r.stderr[-2000:])
        assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert errors == ["error: cannot write the output to stdout: No space left on device"]


def test_trace_check_with_problems_keeps_exit_1_when_its_reader_leaves(tmp_path: Path) -> None:
    """`coda trace check FILE | head -0`: a reader that leaves ends the command quietly, but a
    trace with problems still exits 1 (a verdict is not turned into 0)."""
    text = (ROOT / "tests" / "data" / "faultmix_trace.jsonl").read_text(encoding="utf-8")
    path = tmp_path / "cut.jsonl"
    path.write_text(text[:-40], encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "coda", "trace", "check", str(path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.close()
    _, err_bytes = proc.communicate(timeout=120)
    err = err_bytes.decode()
    assert proc.returncode == 1, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]


def test_e1_generate_dash_reads_the_prompt_from_stdin() -> None:
    """E1: ``coda generate - < prompt.txt`` takes stdin's text, byte for byte (a trailing
    newline, CJK), as the prompt: the same prompt tokens and greedy output as the same text
    given in argv. Before, ``-`` was the prompt itself (one token) and a pipe was ignored."""
    prompt = "Once upon a time, 世界\n"
    argv = [sys.executable, "-m", "coda", "generate", "--temperature", "0", "--max-tokens", "6"]
    piped = subprocess.run([*argv, "-"], cwd=ROOT, input=prompt.encode("utf-8"),
                           capture_output=True, timeout=300)
    given = subprocess.run([*argv, prompt], cwd=ROOT, capture_output=True, timeout=300)
    for r in (piped, given):
        assert r.returncode == 0, r.stderr.decode()[-2000:]
    usage = [ln for ln in piped.stderr.decode().splitlines() if ln.startswith("usage:")]
    assert usage == [ln for ln in given.stderr.decode().splitlines() if ln.startswith("usage:")]
    assert piped.stdout == given.stdout and len(piped.stdout) > 1, (piped.stdout, given.stdout)


def test_e1_generate_dash_with_stdin_that_is_no_utf8_is_exit_2_before_the_load() -> None:
    """E1: stdin bytes that are no UTF-8 text: one ``error:`` line, exit 2, no model loaded."""
    r = subprocess.run([sys.executable, "-m", "coda", "generate", "-"], cwd=ROOT,
                       input=b"caf\xe9\n", capture_output=True, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 2, (r.returncode, err[-2000:])
    assert err == "error: the prompt read from stdin is not valid UTF-8 text\n", err


@pytest.mark.parametrize("argv", [
    ["models"], ["trace", "check", "tests/data/faultmix_trace.jsonl"],
    ["bench", "-n", "1", "--concurrency", "1", "--max-tokens", "2"]])
def test_o1_models_bench_and_trace_check_on_an_ascii_stdout_exit_0(argv: list[str]) -> None:
    """``coda models`` / ``bench`` / ``trace check`` where stdout's encoding lacks a character
    they print (``PYTHONIOENCODING=ascii``, a Latin-1 locale): the character escaped, exit 0.
    The models table's header arrow and the bench title's dash were a UnicodeEncodeError
    traceback, exit 1."""
    r = subprocess.run([sys.executable, "-m", "coda", *argv], cwd=ROOT, capture_output=True,
                       timeout=300, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 0, (r.returncode, err[-2000:])
    assert "Traceback" not in err and r.stdout.isascii() and r.stdout, err[-2000:]
