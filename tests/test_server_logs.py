"""Logs as documented (issue 14 item 6; SPEC O1): every line ``coda serve`` writes to stderr,
uvicorn's own startup and shutdown lines included, is a JSON object."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_o1_serve_writes_json_lines_only(server_checkpoint: Path) -> None:
    """O1: startup ("Uvicorn running ..."), request and shutdown lines are all JSON lines with
    ``level``, ``logger`` and ``msg``; uvicorn's lines come from its ``uvicorn.*`` loggers."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "coda.cli", "serve", "--model", str(server_checkpoint),
         "--port", str(port)], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        end = time.monotonic() + 60
        while time.monotonic() < end:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [ln for ln in err.decode().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # raises on any plain-text line
    assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    assert not any("\x1b[" in line for line in lines)  # no terminal colour codes
    uvicorn = [r for r in records if r["logger"].startswith("uvicorn")]
    assert any("Uvicorn running" in r["msg"] for r in uvicorn)
    assert any("Shutting down" in r["msg"] or "shutdown" in r["msg"].lower() for r in uvicorn)
