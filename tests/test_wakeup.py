"""The one wake-up channel (issue 22 step 4; SPEC P2, P3, P6): the engine thread only appends
and posts; every observer — a stream reader, ``when_closed``, the metrics' one end listener,
the engine's own bookkeeping — runs on the event loop that subscribed, never on
``coda-engine``; the blocking
Python API (``handle.wait``) still wakes without any event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.finish import Terminal
from coda.lifecycle import State
from coda.reader import when_closed
from coda.sampling import SamplingParams
from coda.stream import EventType

from .engine_support import tiny_checkpoint


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    with AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=64)) as eng:
        yield eng


def _req(n: int, rid: str) -> GenerationRequest:
    return GenerationRequest((5, 6, 7), SamplingParams(temperature=0.0, ignore_eos=True),
                             max_tokens=n, request_id=rid)


def test_p2_observers_of_engine_streams_run_on_the_loop_thread(engine: AsyncEngine) -> None:
    """P2 (issue 22 step 4): the reader's wake-ups and ``when_closed`` (what the model router
    observes an end with) run on the loop's thread; before the channel, ``when_closed`` ran
    its callback on the engine thread that appended the terminal."""
    seen: list[str] = []

    async def main() -> tuple[list[int], str]:
        h = engine.submit(_req(12, "wake-1"))
        closed = asyncio.Event()

        def on_close(_t: Terminal) -> None:
            seen.append(threading.current_thread().name)
            closed.set()

        when_closed(h.stream, on_close)
        seqs = [ev.seq async for ev in h.events()]
        await asyncio.wait_for(closed.wait(), 30)
        return seqs, threading.current_thread().name

    seqs, loop_thread = asyncio.run(main())
    assert seqs == list(range(len(seqs))) and len(seqs) >= 3
    assert seen == [loop_thread] and "coda-engine" not in seen


def test_p3_the_blocking_api_wakes_without_an_event_loop(engine: AsyncEngine) -> None:
    """The documented Python API (README): ``handle.wait()`` from a plain thread with no event
    loop returns the terminal; the log holds one terminal, last."""
    h = engine.submit(_req(8, "wake-2"))
    terminal = h.wait(30)
    assert terminal.state is State.FINISHED
    evs = h.stream.events_after(-1)
    assert evs[-1].type is EventType.TERMINAL and evs[-1].terminal == terminal
    with pytest.raises(TimeoutError):
        engine.submit(_req(400, "wake-3")).wait(0)
    assert engine.cancel("wake-3")


def test_c1_cancel_by_id_of_an_ended_request_is_false_and_forgets_it(
        engine: AsyncEngine) -> None:
    """C1: the engine keeps ended requests out of its cancel-by-id map without a listener on
    its own thread: a cancel of an ended one answers False (and drops it)."""
    h = engine.submit(_req(3, "wake-4"))
    h.wait(30)
    assert engine.cancel("wake-4") is False
    assert "wake-4" not in engine._live


def test_p2_one_end_listener_sees_every_stream_end_on_its_loop() -> None:
    """P2 (issue 22 step 4): ``on_end`` is called on its loop's thread, once per stream whose
    terminal is posted after it listens, for streams nobody subscribed to; its remover stops
    it. (The server's metrics listen this way: one listener per app, no subscription per
    request.)"""
    from coda.finish import FinishReason, Usage
    from coda.stream import RequestStream
    from coda.wakeup import WakeChannel

    channel = WakeChannel()
    ended: list[tuple[str, str]] = []

    async def main() -> str:
        loop = asyncio.get_running_loop()
        remove = channel.on_end(lambda s: ended.append(
            (getattr(s, "request_id", "?"), threading.current_thread().name)))
        streams = [RequestStream(f"e{i}", channel=channel, model="m") for i in range(3)]
        done = Terminal(State.FINISHED, FinishReason.EOS, Usage())
        worker = threading.Thread(target=lambda: [s.close(done) for s in streams[:2]])
        await loop.run_in_executor(None, lambda: (worker.start(), worker.join()))
        for _ in range(5):
            await asyncio.sleep(0)
        remove()
        streams[2].close(done)
        for _ in range(5):
            await asyncio.sleep(0)
        assert channel.num_subscribed(streams[0]) == 0
        return threading.current_thread().name

    loop_thread = asyncio.run(main())
    assert ended == [("e0", loop_thread), ("e1", loop_thread)]


def test_p5_the_metrics_count_a_request_that_ended_before_it_was_tracked() -> None:
    """P5, issue 20 D7 (issue 22 step 4): the server's metrics listen before submitting, so a
    request whose terminal is appended (on the engine thread) before ``track`` is still
    observed, once; a stream of the same id not tracked (a durable copy) is not counted; the
    metrics hold no subscription of their own on the stream."""
    from coda.finish import FinishReason, Usage
    from coda.server.metrics import ServerMetrics
    from coda.stream import RequestStream
    from coda.wakeup import CHANNEL

    metrics = ServerMetrics(engine=None)

    def successes() -> float:
        value = metrics.registry.get_sample_value("coda:request_success_total",
                                                  {"finished_reason": "eos"})
        return value or 0.0

    async def main() -> None:
        metrics.listen()
        stream, copy = RequestStream("m-1", model="m"), RequestStream("m-1", model="m")
        done = Terminal(State.FINISHED, FinishReason.EOS, Usage(prompt_tokens=2))
        worker = threading.Thread(target=lambda: (stream.close(done), copy.close(done)))
        worker.start()
        worker.join()  # NOTE: ended before it is tracked
        metrics.track(type("Handle", (), {"stream": stream})())
        assert CHANNEL.num_subscribed(stream) == 0
        for _ in range(5):
            await asyncio.sleep(0)

    asyncio.run(main())
    assert successes() == 1.0


def test_p2_a_subscription_removed_during_a_dispatch_is_not_called_by_it() -> None:
    """P2: an observer that removes another subscription of the same stream in the same
    dispatch keeps it from being called, and only that one: the same callback subscribed
    again on the same loop is a subscription of its own (identity, not an equal pair)."""
    from coda.wakeup import WakeChannel

    channel, source, calls = WakeChannel(), object(), list[int]()

    async def main() -> None:
        done = asyncio.Event()
        rec = calls.append

        def first(_seq: int) -> None:
            remove_second()

        channel.subscribe(source, first)
        remove_second = channel.subscribe(source, rec)
        channel.subscribe(source, rec)
        channel.subscribe(source, lambda _seq: done.set())
        threading.Thread(target=channel.post, args=(source, 1)).start()
        await asyncio.wait_for(done.wait(), 3)

    asyncio.run(main())
    assert calls == [1]
