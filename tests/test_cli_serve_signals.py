"""`coda serve` stopped by SIGTERM or SIGINT shuts down gracefully and exits 0 (the
acceptance sweep found exit -15 and 130: uvicorn raised the signal again after a clean
shutdown, so the process died of it and ``--replicas``' cleanup never ran). A second SIGINT
during the shutdown is uvicorn's force exit and still ends with the signal (exit 130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import uvicorn

from coda.server.app import CodaServer
from tests.scaleout_support import free_port

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stopped_by_a_signal_exits_0_after_a_graceful_shutdown(
        sig: signal.Signals) -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "coda", "serve", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, "the server exited during start-up"
            assert time.monotonic() < deadline, "no /health within 240 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        proc.send_signal(sig)
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    text = err.decode()
    assert proc.returncode == 0, (proc.returncode, text[-2000:])
    assert took < 30, took  # NOTE: nothing in flight: the shutdown takes well under a second
    assert "Traceback" not in text and "Finished server process" in text, text[-2000:]


def _server() -> CodaServer:
    async def app(scope: object, receive: object, send: object) -> None:
        raise AssertionError("never called")

    return CodaServer(uvicorn.Config(app))


def _exits(stop: Callable[[CodaServer], None]) -> str:
    """What leaving ``capture_signals`` does after ``stop`` (run inside it): "returns", or
    "KeyboardInterrupt" when SIGINT is raised again (Python's own handler is restored first)."""
    server = _server()
    try:
        with server.capture_signals():
            stop(server)
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "returns"


def test_one_signal_is_a_graceful_stop_that_returns() -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert _exits(lambda s: s.handle_exit(signal.SIGINT, None)) == "returns"


def test_a_second_sigint_forces_the_exit_and_is_raised_again() -> None:
    def twice(s: CodaServer) -> None:
        s.handle_exit(signal.SIGINT, None)
        s.handle_exit(signal.SIGINT, None)
        assert s.force_exit

    assert _exits(twice) == "KeyboardInterrupt"


def test_serve_port_0_logs_the_port_it_bound() -> None:
    """`serve --port 0` binds a port the system chooses; the ``serving`` log line names that
    port, the one that answers (it said ``"port": 0``, so a script reading the log could not
    find the server)."""
    import json

    proc = subprocess.Popen([sys.executable, "-m", "coda", "serve", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stderr is not None
    try:
        for line in proc.stderr:  # NOTE: JSON lines (O1); the server ends if this test fails
            if line.startswith("{") and json.loads(line).get("msg") == "serving":
                port = json.loads(line)["port"]
                break
        else:
            raise AssertionError("no 'serving' line")
        assert port != 0
        deadline = time.monotonic() + 60
        while True:
            try:
                ok = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                break
            assert time.monotonic() < deadline, f"nothing answers on the logged port {port}"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
