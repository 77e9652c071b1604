"""Retry only before the first frame (seed 004 D5, issue 5 item 3), with injected forward
faults, in the engine and through the HTTP server."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from coda.engine.async_engine import AsyncEngine
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import FinishReason
from coda.lifecycle import State
from coda.sampling import SamplingParams
from coda.trace import ListTraceSink, check_trace

from .conftest import LiveServer


class FlakyRunner(ModelRunner):
    """Fails the next ``failures`` batches that contain a chunk starting at or after
    ``from_pos`` (0 = a prefill fault, before anything was sent). The engine first re-runs a
    failed batch chunk by chunk, so a fault must repeat twice to reach the retry decision."""

    def __init__(self, base: ModelRunner, *, from_pos: int, failures: int) -> None:
        super().__init__(base.model, num_blocks=base.num_blocks, block_size=base.block_size)
        self.from_pos, self.failures, self.calls = from_pos, failures, 0

    def execute(self, chunks: Sequence[SeqChunk]) -> torch.Tensor:
        if self.failures > 0 and any(c.start_pos >= self.from_pos for c in chunks):
            self.failures -= 1
            raise RuntimeError("injected transient device fault")
        return super().execute(chunks)


def engine_with(model_dir: Path, **flaky: int) -> tuple[AsyncEngine, ListTraceSink]:
    sink = ListTraceSink()
    engine = AsyncEngine.from_model_dir(model_dir, EngineConfig(num_blocks=128), trace=sink)
    if flaky:
        engine.runner = engine.core.runner = FlakyRunner(engine.runner, **flaky)
    return engine, sink


REQ = GenerationRequest((5, 6, 7, 8), SamplingParams(temperature=0.7, seed=3, ignore_eos=True),
                        max_tokens=12)


def test_d5_fault_before_first_frame_is_retried_and_output_is_unchanged(
        server_checkpoint: Path) -> None:
    clean, _ = engine_with(server_checkpoint)
    with clean:
        want = clean.submit(REQ)
        want.wait(60)
    flaky, sink = engine_with(server_checkpoint, from_pos=0, failures=2)
    with flaky:
        got = flaky.submit(REQ)
        t = got.wait(60)
        assert flaky.core.num_retries_total == 1
    assert t.state is State.FINISHED and t.finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert got.stream.text() == want.stream.text()
    errors = [e for e in sink.events if e.kind == "error"]
    assert [e.data["decision"] for e in errors] == ["retry-allowed"]
    assert check_trace(sink.events) == []


def test_d5_fault_after_first_frame_is_final_and_committed_tokens_are_billed(
        server_checkpoint: Path) -> None:
    flaky, sink = engine_with(server_checkpoint, from_pos=4 + 5, failures=5)
    with flaky:
        h = flaky.submit(REQ)
        t = h.wait(60)
        assert flaky.core.num_retries_total == 0
        stats = flaky.stats()
    assert t.state is State.FAILED and t.finish_reason is FinishReason.MODEL_ERROR
    assert h.stream.text() != ""  # what was sent stands
    assert t.usage.selected_tokens == 6  # committed tokens are reported (billed)
    errors = [e for e in sink.events if e.kind == "error"]
    assert [e.data["decision"] for e in errors] == ["no-retry-after-first-frame"]
    assert stats.num_free_blocks == stats.num_blocks
    assert check_trace(sink.events) == []


def test_d5_persistent_fault_is_retried_once_then_fails(server_checkpoint: Path) -> None:
    flaky, sink = engine_with(server_checkpoint, from_pos=0, failures=100)
    with flaky:
        t = flaky.submit(REQ).wait(60)
    assert t.state is State.FAILED and t.finish_reason is FinishReason.MODEL_ERROR
    decisions = [e.data["decision"] for e in sink.events if e.kind == "error"]
    assert decisions == ["retry-allowed", "error-not-retryable"]


def _chat_stream(url: str) -> list[dict[str, Any]]:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 12, "stream": True, "temperature": 0.7, "seed": 3,
            "ignore_eos": True}
    frames: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[6:]))
    return frames


def _text(frames: list[dict[str, Any]]) -> str:
    return "".join(c["delta"].get("content") or "" for f in frames
                   for c in f.get("choices", []))


def test_d5_retry_through_the_server(server_checkpoint: Path) -> None:
    from coda.server.app import create_app

    outcomes = {}
    for name, flaky in (("clean", {}), ("before", {"from_pos": 0, "failures": 2}),
                        ("after", {"from_pos": 20, "failures": 5})):
        engine, _ = engine_with(server_checkpoint, **flaky)
        live = LiveServer(create_app(engine)).start()
        try:
            outcomes[name] = _chat_stream(live.url)
        finally:
            live.stop()
    assert _text(outcomes["before"]) == _text(outcomes["clean"]) != ""
    after = outcomes["after"]
    assert _text(after) != "" and _text(after) != _text(outcomes["clean"])
    final = [f for f in after if "error" in f or any("coda" in c for c in f.get("choices", []))]
    assert final, after[-3:]
    blob = json.dumps(final)
    assert "model_error" in blob
