"""One `coda serve --model NAME=SPEC` serves SPEC under NAME, as each of several does
(docs/api.md "Several models": each `SPEC` or `NAME=SPEC`; `default` is the embedded model);
it was read as a path and refused: "model 'smol=default' not found"."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.scaleout_support import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_one_named_model_is_served_under_its_name() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "coda.cli", "serve", "--model", "smol=default",
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            assert proc.poll() is None, proc.stderr.read()[-2000:] if proc.stderr else ""
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        ids = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=10).json()["data"]]
        assert ids == ["smol"]
        r = httpx.post(f"{base}/v1/completions", timeout=60,
                       json={"model": "smol", "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        proc.terminate()
        proc.wait(60)
