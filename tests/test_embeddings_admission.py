"""Embeddings pass the server's admission rule like any request (docs/api.md, "Admission";
SPEC L5, P1): a call is one engine request, so a full waiting queue answers 429 +
``Retry-After`` before anything is embedded, and a server shutting down answers 503 in the
protocol's own shape. Before, ``/v1/embeddings`` (and Ollama's two routes) ran between engine
steps past all of these, through the official ``openai`` and ``ollama`` clients over loopback.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest

from coda.server.state import ServerSettings
from tests.admission_support import queue_full
from tests.conftest import LiveServer

MODEL = "tiny-chat"


@pytest.fixture
def one_slot(server_checkpoint: Path) -> Iterator[tuple[Any, list[list[int]]]]:
    """An engine with one batch slot, and the inputs of every embedding it was asked for."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(max_num_seqs=1,
                                                                        num_blocks=128))
    embedded: list[list[int]] = []
    embed = engine.embed

    async def spy(token_ids: list[int]) -> list[float]:
        embedded.append(list(token_ids))
        return await embed(token_ids)

    engine.embed = spy  # type: ignore[method-assign]
    yield engine, embedded


def _serve(engine: Any, max_waiting: int) -> LiveServer:
    from coda.server.app import create_app

    return LiveServer(create_app(engine, settings=ServerSettings(max_waiting=max_waiting))).start()


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0)


def test_embeddings_are_refused_429_on_a_full_queue_l5(
        one_slot: tuple[Any, list[list[int]]]) -> None:
    """L5: one request running, one waiting, ``max_waiting=1``: ``/v1/embeddings`` is the 429
    ``overloaded`` with ``Retry-After`` a chat gets, nothing is embedded; Ollama's
    ``/api/embed`` Ollama's own busy answer (503). Once the queue drains the same call answers."""
    engine, embedded = one_slot
    live = _serve(engine, max_waiting=1)
    try:
        with queue_full(live, engine, MODEL):
            with pytest.raises(openai.RateLimitError) as err:
                _client(live).embeddings.create(model=MODEL, input="hello there")
            assert err.value.status_code == 429
            assert err.value.response.headers["retry-after"] == "1"
            assert err.value.code == "overloaded"
            with pytest.raises(ollama.ResponseError) as oerr:
                ollama.Client(host=live.url).embed(model=MODEL, input="hello there")
            assert oerr.value.status_code == 503 and "overloaded" in oerr.value.error
            assert embedded == [], "a refused embedding must run nothing"
        got = _client(live).embeddings.create(model=MODEL, input="hello there")
        assert len(got.data) == 1 and len(embedded) == 1
    finally:
        live.stop()


def test_an_embedding_batch_is_one_request_l5(
        one_slot: tuple[Any, list[list[int]]]) -> None:
    """L5: a call is one engine request whatever its number of inputs (they run one at a
    time, never more than one waiting), so three inputs pass ``max_waiting=2`` and OpenAI's
    2048-input batches pass any bound; one list of token ids is one input."""
    engine, embedded = one_slot
    live = _serve(engine, max_waiting=2)
    try:
        got = _client(live).embeddings.create(model=MODEL, input=["a b", "c d", "e f"])
        assert [d.index for d in got.data] == [0, 1, 2]
        assert len(_client(live).embeddings.create(model=MODEL, input=[5, 6, 7]).data) == 1
        assert len(embedded) == 4
    finally:
        live.stop()


def test_embeddings_while_shutting_down_are_a_503_p1(
        one_slot: tuple[Any, list[list[int]]]) -> None:
    """P1: once the server is draining, an embedding is the 503 ``engine_shutdown`` a chat
    gets (OpenAI's shape; Ollama's ``{"error"}``), never run on an engine about to stop."""
    engine, embedded = one_slot
    live = _serve(engine, max_waiting=4)
    try:
        live.app.state.coda.shutting_down = True
        with pytest.raises(openai.InternalServerError) as err:
            _client(live).embeddings.create(model=MODEL, input="hello")
        assert err.value.status_code == 503 and err.value.code == "engine_shutdown"
        with pytest.raises(openai.InternalServerError):
            _client(live).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        with pytest.raises(ollama.ResponseError) as oerr:
            ollama.Client(host=live.url).embeddings(model=MODEL, prompt="hello")
        assert oerr.value.status_code == 503 and "shutting down" in oerr.value.error
        assert embedded == []
    finally:
        live.app.state.coda.shutting_down = False
        live.stop()


def test_a_queued_embedding_fills_the_waiting_queue_l5(
        one_slot: tuple[Any, list[list[int]]]) -> None:
    """L5: an embedding waiting for the engine thread is a waiting request: with one
    embedding running (held) and one queued behind it, ``max_waiting=1`` refuses another
    embedding with the 429 (before, embeddings never counted, and it queued past the bound;
    it holds no batch slot, so the free one does not take it: tests/test_admit_burst.py).
    Released, both accepted embeddings answer: nothing accepted is lost."""
    import threading
    import time

    engine, embedded = one_slot
    live = _serve(engine, max_waiting=1)
    hold = threading.Event()
    running = threading.Event()
    forward = engine.runner.embed_rows

    def held(*args: Any) -> Any:
        running.set()
        hold.wait(60)
        return forward(*args)

    engine.runner.embed_rows = held
    answers: list[int] = []

    def embed_one() -> None:
        answers.append(len(_client(live).embeddings.create(model=MODEL, input="hi").data))

    try:
        first = threading.Thread(target=embed_one)
        first.start()
        assert running.wait(30)
        second = threading.Thread(target=embed_one)
        second.start()
        deadline = time.monotonic() + 10
        while engine.num_waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as err:
            _client(live).with_options(timeout=10).embeddings.create(model=MODEL, input="hi")
        assert err.value.code == "overloaded"
        hold.set()
        first.join(60)
        second.join(60)
        assert answers == [1, 1] and len(embedded) == 2
    finally:
        hold.set()
        engine.runner.embed_rows = forward
        live.stop()
