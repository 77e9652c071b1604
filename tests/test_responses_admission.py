"""A background response is ``queued`` while it waits for a batch slot and ``in_progress``
from its admission, before its first token (SPEC P1, P2, P3): the engine writes the request's
``start`` event when it schedules its first prefill chunk
(``GenerationRequest.start_at_admission``), so retrieve and the event stream read it from the
log. Through the official ``openai`` client against the real engine and server over the
scripted default model (tests/wire_support.py), on one batch slot, whose runner holds the
engine inside a prefill chunk on request: what each status is while held is then certain (no
timing)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import openai
import pytest
import torch

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.types import EngineConfig, GenerationRequest
from coda.lifecycle import State
from coda.stream import EventType
from tests.wire_support import EOS_ID, X_ID, ScriptedRunner, served_runner

# NOTE: ~600 prompt tokens, prefilled in 128-token chunks: the first ones compute no logits
LONG = "the quick brown fox jumps over the lazy dog " * 60


class HeldRunner(ScriptedRunner):
    """Answers "x" then EOS; while ``release`` is clear, a prefill chunk that computes no
    logits (the prompt's middle: no token can exist yet) sets ``held`` and waits."""

    def __init__(self, base: ModelRunner) -> None:
        super().__init__(base, {X_ID: EOS_ID})
        self.held, self.release = threading.Event(), threading.Event()
        self.release.set()

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        if not self.release.is_set() and not any(c.need_logits for c in chunks):
            self.held.set()
            self.release.wait(30)
        return super().execute(chunks)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, HeldRunner, AsyncEngine]]:
    config = EngineConfig(num_blocks=128, max_num_seqs=1, long_prefill_chunk=128,
                          max_num_batched_tokens=128, enable_prefix_caching=False)
    with contextmanager(served_runner)(HeldRunner, config=config) as served:
        runner = served.engine.runner
        assert isinstance(runner, HeldRunner)
        try:
            yield (openai.OpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0),
                   runner, served.engine)
        finally:
            runner.release.set()  # NOTE: before the engine's shutdown joins its thread


@pytest.fixture
def held(served: tuple[openai.OpenAI, HeldRunner, AsyncEngine]
         ) -> Iterator[tuple[openai.OpenAI, HeldRunner, AsyncEngine]]:
    """The runner set to hold the next prefill chunk; released (at the latest) on teardown."""
    _, runner, _ = served
    runner.held.clear()
    runner.release.clear()
    try:
        yield served
    finally:
        runner.release.set()


def _create(oa: openai.OpenAI, **kw: Any) -> Any:
    model = oa.models.list().data[0].id
    return oa.responses.create(model=model, input=LONG, background=True, store=True,
                               max_output_tokens=16, **kw)


def _settled(oa: openai.OpenAI, rid: str) -> Any:
    deadline = time.monotonic() + 30
    while (got := oa.responses.retrieve(rid)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, got.status
        time.sleep(0.01)
    return got


def test_p1_in_progress_while_the_prompt_is_prefilled(held: Any) -> None:
    """P1: held inside its prefill (no token yet), a background response reads
    ``in_progress`` (it read ``queued`` until its first token), with no output item yet
    (``output: []``, as OpenAI's until its first ``output_item.added``; it showed an open,
    empty message item)."""
    oa, runner, _ = held
    created = _create(oa)
    assert created.status == "queued"  # NOTE: the create's answer: before the engine saw it
    assert runner.held.wait(10), "the engine never reached the prefill"
    got = oa.responses.retrieve(created.id)
    assert got.status == "in_progress" and got.output == [] and got.usage is None
    runner.release.set()
    done = _settled(oa, created.id)
    assert done.status == "completed" and done.output_text == "x"


def test_p1_queued_while_the_one_slot_is_busy(held: Any) -> None:
    """P1: with the one batch slot held by a request in its prefill, a second background
    response reads ``queued`` (the first ``in_progress``) until the slot frees."""
    oa, runner, engine = held
    first = _create(oa)
    assert runner.held.wait(10), "the engine never reached the prefill"
    second = _create(oa)
    assert engine.num_queued() >= 1  # NOTE: submitted, and no step can admit it while held
    waiting = oa.responses.retrieve(second.id)
    assert waiting.status == "queued" and waiting.output == [] and waiting.usage is None
    assert oa.responses.retrieve(first.id).status == "in_progress"
    runner.release.set()
    assert _settled(oa, first.id).status == "completed"
    assert _settled(oa, second.id).status == "completed"


def test_p1_p3_stream_sends_in_progress_at_admission(held: Any) -> None:
    """P1, P2, P3: streamed, ``response.created``, ``response.queued``, then
    ``response.in_progress`` while the prompt is still being prefilled (it waited for the first
    token); the message item is announced with the first token (``output_item.added`` right
    after the prefill), and retrieve shows no item before it; the replay from the log is the
    same events."""
    oa, runner, _ = held
    timer = threading.Timer(10, runner.release.set)  # NOTE: a bound on a failing run only
    timer.start()
    try:
        with _create(oa, stream=True) as stream:
            events = iter(stream)
            head = [next(events) for _ in range(3)]
            assert [e.type for e in head] == ["response.created", "response.queued",
                                              "response.in_progress"]
            assert not runner.release.is_set(), "in_progress came after the prefill"
            assert oa.responses.retrieve(head[0].response.id).output == []
            runner.release.set()
            rest = list(events)
    finally:
        timer.cancel()
    assert [e.type for e in rest[:3]] == ["response.output_item.added",
                                          "response.content_part.added",
                                          "response.output_text.delta"]
    assert rest[-1].type == "response.completed"
    whole = head + rest
    assert [e.sequence_number for e in whole] == list(range(len(whole)))
    replay = list(oa.responses.retrieve(head[0].response.id, stream=True))
    assert [e.model_dump() for e in replay] == [e.model_dump() for e in whole]



def test_p1_p2_start_at_admission_in_the_engine_and_a_queued_cancel(held: Any) -> None:
    """P1, P2, with the engine's Python API: a ``start_at_admission`` request's log is empty
    while it waits and opens with ``start`` once admitted (before any token); one cancelled
    while queued still writes ``start`` (with the model's snapshot) before its terminal."""
    _, runner, engine = held
    ids = tuple(engine.tokenizer.encode(LONG).ids)
    first = engine.submit(GenerationRequest(ids, max_tokens=4, start_at_admission=True))
    assert runner.held.wait(10), "the engine never reached the prefill"
    second = engine.submit(GenerationRequest(ids, max_tokens=4, start_at_admission=True))
    assert [e.type for e in first.stream.events_after(-1)] == [EventType.START]
    assert second.stream.events_after(-1) == []
    assert second.cancel()  # NOTE: C1's request, recorded now; observed while still queued
    runner.release.set()
    assert first.wait(30).state is State.FINISHED
    assert second.wait(30).state is State.CANCELLED
    start, end = second.stream.events_after(-1)
    assert (start.seq, start.type, end.seq, end.type) == (0, EventType.START, 1,
                                                          EventType.TERMINAL)
    assert start.model_snapshot == engine.model_snapshot == end.terminal.model_snapshot
