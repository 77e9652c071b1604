"""`coda generate ... | head -c 20` ends quietly, as a Unix tool whose reader left (SPEC C1: the
request is cancelled, L7: the engine shuts down, nothing left running): exit 0, no traceback,
no "Exception ignored" at the interpreter's exit, no terminal line, and it ends at once rather
than generating the rest. Before, the write's BrokenPipeError reached click, which exited 1."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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
