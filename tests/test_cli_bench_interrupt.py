"""Ctrl-C during `coda bench` prints the report of the requests that finished, then exits 130
(SPEC P1: the figures a bench reports are the requests it ran). It exited 130 with nothing
printed: minutes of a workload measured and no figure shown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_p1_sigint_during_bench_prints_the_finished_requests_report_and_exits_130(
        smollm_gguf: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "coda.cli", "bench", "--model", str(smollm_gguf),
                             "-n", "400", "--concurrency", "2", "--max-tokens", "4",
                             "--max-model-len", "512"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, COLUMNS="200"))
    assert proc.stderr is not None
    err: list[str] = []
    loaded = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            err.append(line)
            if line.startswith("KV cache"):
                loaded.set()

    threading.Thread(target=read, daemon=True).start()
    assert loaded.wait(120), "".join(err)[-2000:]
    time.sleep(4)  # NOTE: past the warm-up request, some of the 400 finished, not all
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, out[-2000:], "".join(err)[-2000:])
    assert "interrupted (SIGINT)" in out and " of 400 requests finished" in out, out
    assert "output throughput" in out and "Traceback" not in "".join(err)
