"""The five L7 resources of one request each release something real, and say so in the trace;
the replay log outlives the stream buffer's release; the block manager is checked whenever
the engine goes idle (SPEC L7, P3, P6; issue 11 items 2 and 5)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from coda import trace as tr
from coda.engine.async_engine import AsyncEngine
from coda.engine.engine_request import EngineRequest
from coda.engine.kv_cache import KVCacheError
from coda.engine.plan import ModelLimits, plan_request
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import FinishReason, Terminal, Usage
from coda.lifecycle import ResourceKind, State
from coda.request import RequestRun
from coda.sampling import SamplingParams
from coda.stream import RequestStream, StreamClosed
from coda.trace import ListTraceSink, TraceEvent, TraceHandle, TraceSink, check_trace

from .engine_support import tiny_checkpoint
from .scripted import scripted_tokenizer

HAPPY = (State.QUEUED, State.PREFILLING, State.DECODING)


def _released(sink: ListTraceSink, rid: str) -> dict[str, dict[str, object]]:
    return {str(e.data["resource"]): dict(e.data) for e in sink.of(rid)
            if e.kind == tr.RESOURCE_RELEASED}


def test_l7_p3_engine_releases_are_real_and_traced_and_the_log_stays_replayable() -> None:
    """L7: every kind is acquired and released once; the RNG row reports the cursor's last
    step (= selected tokens), the stream buffer row the credit it returned, the trace handle
    row the rows written before it, and that row is the request's last. P3: after the
    release the stream is no longer live, yet a resume from -1 replays every event."""
    sink = ListTraceSink()
    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=64),
                                        trace=sink)
    with engine:
        h = engine.submit(GenerationRequest((5, 6, 7), SamplingParams(temperature=0.0,
                                                                      ignore_eos=True),
                                            max_tokens=6, request_id="r1"))
        term = h.wait(30)
        rows = sink.of("r1")
        rel = _released(sink, "r1")
        assert set(rel) == {k.value for k in ResourceKind}
        assert all(r["ok"] is True for r in rel.values())
        assert rel["rng_state"]["step"] == term.usage.selected_tokens == 6
        # NOTE: nobody read the stream, so all output bytes were still owed as credit
        assert rel["stream_buffer"]["unacked_bytes"] == term.usage.returned_bytes > 0
        assert rows[-1].kind == tr.RESOURCE_RELEASED and rows[-1].data["resource"] == "trace_handle"
        assert rel["trace_handle"]["rows"] == len(rows) - 1
        assert check_trace(sink.events) == []
        assert not h.stream.live and h.stream.unacked_bytes == 0 and not h.stream.should_pause

        async def replay() -> list[int]:
            return [ev.seq async for ev in engine.attach("r1", -1)]

        assert asyncio.run(replay()) == list(range(h.stream.last_seq + 1))


def _finished_run(sink: TraceSink) -> RequestRun:
    """A request run from start to an EOS finish, traced to ``sink``."""
    stream = RequestStream("r")
    run = RequestRun("r", stream, sink, prompt_tokens=1)
    stream.start("m")
    for s in HAPPY:
        run.lifecycle.transition(s)
    run.finish(FinishReason.EOS)
    return run


def test_l7_released_rng_state_refuses_a_draw() -> None:
    """L7, T4: the released RNG state (the engine request's seed and step) cannot feed another
    sampling row; the release reports the last step."""
    plan = plan_request(GenerationRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(seed=42),
                                          max_tokens=4, request_id="r"),
                        ModelLimits(context_length=64, vocab_size=300, eos_token_ids=frozenset({0})))
    req = EngineRequest(plan, 0, scripted_tokenizer({1: b"a", 2: b"b"}), ListTraceSink(),
                        arrival=0.0)
    assert (req.prompt_token_ids, req.max_total_tokens) == ([1, 2], 6)
    req.rng_step = 3
    assert req.rng_seed == 42
    assert req.release_rng() == {"step": 3}
    with pytest.raises(RuntimeError):
        _ = req.rng_seed


def test_l7_trace_handle_seals_the_request_trace() -> None:
    """L7: after the trace handle's release a late row for the request is not written (it is
    counted), so the trace still ends with the handle's own release row."""
    sink = ListTraceSink()
    run = _finished_run(sink)
    assert isinstance(run.trace, TraceHandle)
    n = len(sink.events)
    run.trace.record(TraceEvent("r", tr.ERROR, {"error": "late"}))
    assert len(sink.events) == n and run.trace.late_rows == 1
    assert sink.events[-1].data.get("resource") == "trace_handle"
    assert check_trace(sink.events) == []
    run.trace.emit(tr.ERROR, {"error": "late too"})
    assert len(sink.events) == n and run.trace.late_rows == 2


def test_l7_o1_a_null_sink_counts_the_rows_it_never_builds() -> None:
    """L7, O1: a request traced to a null sink writes nothing, yet its handle counts every row
    offered (the release row reports the same count as with a real sink) and still seals."""
    counts = []
    for sink in (ListTraceSink(), tr.NullTraceSink()):
        run = _finished_run(sink)
        counts.append(run.trace.rows)
        run.trace.emit(tr.ERROR, {"error": "late"})
        assert run.trace.late_rows == 1 and run.trace.rows == counts[-1]
    real = ListTraceSink()
    handle = TraceHandle(real, "x")
    handle.emit(tr.ERROR, {"error": "e"})
    assert [(e.request_id, e.kind, dict(e.data)) for e in real.events] == [
        ("x", tr.ERROR, {"error": "e"})]
    assert counts[0] == counts[1] and counts[0] > 5


def test_p6_l7_stream_buffer_release_returns_credit_and_needs_the_terminal() -> None:
    """P6, L7: the stream buffer is released only after the terminal; the release returns the
    unacknowledged credit and counts the observers still subscribed (the channel drops them
    after the terminal's wake-up); a later ack cannot drive it negative, and the log is still
    readable (P3)."""
    stream = RequestStream("s")
    stream.start("m")
    stream.delta(b"abc")
    loop = asyncio.new_event_loop()
    stream.subscribe(lambda _seq: None, loop)
    with pytest.raises(StreamClosed):
        stream.release_live()
    run = RequestRun("s", stream, ListTraceSink(), prompt_tokens=1)
    for s in HAPPY:
        run.lifecycle.transition(s)
    run.finish(FinishReason.EOS)
    rows = run.trace.sink.events  # type: ignore[attr-defined]
    buf = next(e.data for e in rows if e.kind == tr.RESOURCE_RELEASED
               and e.data["resource"] == "stream_buffer")
    assert buf["unacked_bytes"] == 3 and buf["listeners"] == 1
    stream.ack(stream.last_seq)
    assert stream.unacked_bytes == 0
    assert [e.seq for e in stream.events_after(-1)] == [0, 1, 2]
    loop.run_until_complete(asyncio.sleep(0))  # NOTE: the terminal's wake-up drops it
    loop.close()
    assert stream.release_live() == {"unacked_bytes": 0, "listeners": 0}


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_l7_block_manager_integrity_is_checked_whenever_the_engine_goes_idle(
        caplog: pytest.LogCaptureFixture) -> None:
    """L7 (issue 11 item 5): each busy -> idle transition runs the block manager's
    check_integrity in service; a failure is logged and counted, never raised into the loop,
    and the engine keeps serving."""
    engine = AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=64))
    req = GenerationRequest((5, 6, 7), SamplingParams(temperature=0.0, ignore_eos=True),
                            max_tokens=3)
    with engine:
        assert engine.submit(req).wait(30).state is State.FINISHED
        assert _wait_for(lambda: engine.idle_checks >= 1)
        assert engine.idle_check_failures == 0
        bm = engine.core.scheduler.block_manager

        def broken() -> None:
            raise KVCacheError("block 3 is free and owned")

        bm.check_integrity = broken  # type: ignore[method-assign]
        before = engine.idle_checks
        assert engine.submit(req).wait(30).state is State.FINISHED
        assert _wait_for(lambda: engine.idle_check_failures >= 1)
        assert engine.idle_checks > before
        assert "integrity check failed" in caplog.text and "block 3" in caplog.text
        assert engine.submit(req).wait(30).state is State.FINISHED  # NOTE: still serving


def test_l2_l3_p2_a_held_terminal_is_fixed_but_unseen_until_published() -> None:
    """``close(hold=True)`` (RequestRun._end): the terminal's seq is fixed and nothing can
    follow it (no delta, no second terminal: L2, L3), the stream buffer may be released,
    but readers see no end until :meth:`RequestStream.publish` appends it and wakes them
    (P2); a second publish, or one with nothing held, does nothing."""
    stream = RequestStream("h", model="m")
    stream.publish()  # NOTE: nothing held yet: no end, and the stream still takes deltas
    assert not stream.closed and stream.terminal is None
    stream.delta(b"ab")
    ev = stream.close(_terminal(), hold=True)
    assert ev.seq == 2
    with pytest.raises(StreamClosed):
        stream.delta(b"c")
    with pytest.raises(StreamClosed):
        stream.close(_terminal())
    assert not stream.closed and stream.terminal is None and stream.last_seq == 1
    assert not stream.wait_after(1, timeout=0)
    assert stream.release_live() == {"unacked_bytes": 2, "listeners": 0}
    stream.publish()
    assert stream.closed and stream.last_seq == 2 and stream.terminal is ev.terminal
    assert stream.wait_after(1, timeout=0)
    stream.publish()
    assert [e.seq for e in stream.events_after(-1)] == [0, 1, 2]


def _terminal() -> Terminal:
    return Terminal(State.FINISHED, FinishReason.EOS, Usage(prompt_tokens=1))
