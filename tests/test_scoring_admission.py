"""Prompt scoring (legacy completions ``echo`` + ``logprobs``, lm-eval's ``max_tokens: 0``)
passes the server's admission rule like any request (docs/api.md, "Overload"; SPEC L5, O1):
its scoring engine requests are engine requests, so a full waiting queue answers 429 +
``Retry-After`` *before* the prompt is scored, and a batch of more prompts than the server
could ever hold (its batch slots and ``--max-waiting`` waiting) is a 400 before any is scored. Before, the scoring requests were
submitted past the bound (the 429/400 came only after the scoring had run), through the
official ``openai`` client over loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from coda.server.state import ServerSettings
from tests.admission_support import queue_full
from tests.conftest import LiveServer

MODEL = "tiny-chat"
SCORE = {"model": MODEL, "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}


@pytest.fixture
def one_slot(server_checkpoint: Path) -> Iterator[tuple[Any, list[str]]]:
    """An engine with one batch slot, and the ids of every engine request submitted to it."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig

    engine = AsyncEngine.from_model_dir(server_checkpoint, EngineConfig(max_num_seqs=1,
                                                                        num_blocks=128))
    submitted: list[str] = []
    submit = engine.submit

    def spy(req: Any) -> Any:
        submitted.append(req.request_id)
        return submit(req)

    engine.submit = spy  # type: ignore[method-assign]
    yield engine, submitted


def _client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0)


def test_scoring_is_refused_429_on_a_full_queue_before_it_is_scored_l5(
        one_slot: tuple[Any, list[str]]) -> None:
    """L5: one request running, one waiting, ``max_waiting=1``: a scoring request is the
    429 ``overloaded`` with ``Retry-After`` any request gets, and no scoring engine request
    was submitted for it (nothing is queued)."""
    from coda.server.app import create_app

    engine, submitted = one_slot
    live = LiveServer(create_app(engine, settings=ServerSettings(max_waiting=1))).start()
    try:
        with queue_full(live, engine, MODEL):
            before = list(submitted)
            with pytest.raises(openai.RateLimitError) as err:
                _client(live).completions.create(**SCORE, prompt="Hello there, world")
            assert err.value.status_code == 429
            assert err.value.response.headers["retry-after"] == "1"
            assert err.value.code == "overloaded"
            assert submitted == before, "a refused scoring request must queue nothing"
        # NOTE: the queue drained: the same scoring request is admitted and answered
        r = _client(live).completions.create(**SCORE, prompt="Hello there, world")
        assert r.choices[0].text == "Hello there, world" and r.usage.completion_tokens == 0
        assert any("-echo" in rid for rid in submitted)
    finally:
        live.stop()


def test_scoring_batch_over_the_bound_is_a_400_before_it_is_scored_l5(
        one_slot: tuple[Any, list[str]]) -> None:
    """L5: four prompts against one batch slot and ``max_waiting=2`` can never be admitted:
    the 400 any such batch gets, before any of them is scored (no engine request
    submitted)."""
    from coda.server.app import create_app

    engine, submitted = one_slot
    live = LiveServer(create_app(engine, settings=ServerSettings(max_waiting=2))).start()
    try:
        with pytest.raises(openai.BadRequestError) as err:
            _client(live).completions.create(**SCORE, prompt=["a b", "c d", "e f", "g h"])
        assert "more than the 3 this server can ever hold" in err.value.message
        assert submitted == []
    finally:
        live.stop()
