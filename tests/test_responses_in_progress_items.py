"""A background response with tools retrieved while it is generating shows exactly the output
items its stream has announced so far (SPEC P1, P3): an open call the tool-call parser still
holds is no text of the message item, as the stream has not sent it. Through the official ``openai`` client against the real engine and
server over the default model scripted by position (tests/wire_support.py), whose runner holds
the engine at a chosen output position on request, so what retrieve reads is certain (no
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

from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.types import EngineConfig
from tests.wire_support import PositionRunner, served_runner

TOOLS: Any = [{"type": "function", "name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
# NOTE: compact arguments, as the grammar writes them
SCRIPT = 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'


class HeldAt(PositionRunner):
    """:class:`PositionRunner` that, while ``release`` is clear, waits before computing the
    token at output position ``hold_at`` (absolute), so the tokens before it are all out."""

    def __init__(self, base: ModelRunner) -> None:
        super().__init__(base)
        self.hold_at = -1
        self.held, self.release = threading.Event(), threading.Event()
        self.release.set()

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        if not self.release.is_set() and any(
                c.need_logits and c.start_pos + len(c.token_ids) == self.hold_at for c in chunks):
            self.held.set()
            self.release.wait(30)
        return super().execute(chunks)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[openai.OpenAI, HeldAt, list[str], int]]:
    """The client, the runner, the script's text after each of its tokens, the prompt's
    length."""
    with contextmanager(served_runner)(
            HeldAt, config=EngineConfig(num_blocks=64, max_num_seqs=1)) as served:
        engine, runner = served.engine, served.engine.runner
        assert isinstance(runner, HeldAt)
        oa = openai.OpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0)
        probe = oa.responses.create(model=engine.model_name, input="weather?", tools=TOOLS,
                                    max_output_tokens=16)
        assert probe.usage is not None
        ids = engine.tokenizer.encode(SCRIPT, add_special_tokens=False).ids
        runner.script = {probe.usage.input_tokens + i: t for i, t in enumerate(ids)}
        texts = [engine.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
        try:
            yield oa, runner, texts, probe.usage.input_tokens
        finally:
            runner.release.set()  # NOTE: before the engine's shutdown joins its thread


def test_p1_p3_retrieve_shows_only_what_the_stream_announced(
        served: tuple[openai.OpenAI, HeldAt, list[str], int]) -> None:
    """P1, P3: held after ``Hi `` and an open call (its tag and the start of its JSON), the
    retrieved output is one message item holding ``Hi `` and no call (it showed the open call
    as message text, which the stream never sends); once done, the message ``Hi `` then the
    call, and the replayed stream's text deltas are ``Hi `` exactly. (A held tag prefix,
    ``Hi <tool``, never reaches the log: the stop matcher holds it, docs/api.md.)"""
    oa, runner, texts, prompt = served
    k = next(k for k, t in enumerate(texts) if '{"name' in t)  # NOTE: tokens out when held
    runner.hold_at = prompt + k
    runner.held.clear()
    runner.release.clear()
    try:
        created = oa.responses.create(model=oa.models.list().data[0].id, input="weather?",
                                      tools=TOOLS, background=True, store=True,
                                      max_output_tokens=len(texts) - 1,
                                      extra_body={"temperature": 0.0})
        assert runner.held.wait(10), "the engine never reached the position"
        got = oa.responses.retrieve(created.id)
    finally:
        runner.release.set()
    assert got.status == "in_progress"
    assert [o.type for o in got.output] == ["message"], texts[k]
    assert got.output_text == "Hi "
    deadline = time.monotonic() + 30
    while (done := oa.responses.retrieve(created.id)).status == "in_progress":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert [o.type for o in done.output] == ["message", "function_call"]
    assert done.output_text == "Hi "
    replay = list(oa.responses.retrieve(created.id, stream=True))
    assert "".join(e.delta for e in replay if e.type == "response.output_text.delta") == "Hi "
