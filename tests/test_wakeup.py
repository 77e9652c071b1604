"""The one wake-up channel (issue 22 step 4; SPEC P2, P3, P6): the engine thread only appends
and posts; every observer — a stream reader, the metrics' ``when_closed``, the engine's own
bookkeeping — runs on the event loop that subscribed, never on ``coda-engine``; the blocking
Python API (``handle.wait``) still wakes without any event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from coda.engine.async_engine import AsyncEngine
from coda.engine.types import EngineConfig, GenerationRequest
from coda.lifecycle import State
from coda.reader import when_closed
from coda.sampling import SamplingParams
from coda.stream import EventType, Terminal

from .engine_support import tiny_checkpoint


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    with AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=64)) as eng:
        yield eng


def _req(n: int, rid: str) -> GenerationRequest:
    return GenerationRequest((5, 6, 7), SamplingParams(temperature=0.0, ignore_eos=True),
                             max_tokens=n, request_id=rid)


def test_p2_observers_of_engine_streams_run_on_the_loop_thread(engine: AsyncEngine) -> None:
    """P2 (issue 22 step 4): the reader's wake-ups and ``when_closed`` (what the server's
    metrics observe with) run on the loop's thread; before the channel, ``when_closed`` ran
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
