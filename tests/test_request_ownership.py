"""The Python API's request ownership (README "Python API"): a ``request_id`` names one live
request, and the handle's event iterator owns the request it reads.

- A second ``submit`` with the id of a request still running is refused with
  :class:`~coda.errors.DuplicateRequestIdError` before anything is acquired (before, it was
  accepted and ``cancel`` / ``attach`` by id reached only the later one); an ended request's id
  may be used again (C1: a cancel by id reaches the one request it names; P3: so does a resume).
- Leaving ``handle.events()`` before the terminal — ``break``, ``aclose()``, the reading task
  cancelled, the iterator garbage-collected — cancels the request (P4: the Python API's
  declared policy for a reader that goes away; C1: CANCELLED, reason ``cancelled``; L7: every
  resource released exactly once). Before, the request ran on to its budget with no reader.
  Readers that do not own it (``engine.attach``, ``wait``, ``result``) never end it.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coda import trace as tr
from coda.engine.async_engine import AsyncEngine
from coda.engine.protocol import RequestHandle
from coda.engine.types import EngineConfig, GenerationRequest
from coda.errors import DuplicateRequestIdError, InvalidRequestError
from coda.finish import FinishReason
from coda.lifecycle import ResourceKind, State
from coda.sampling import SamplingParams
from coda.stream import StreamEvent
from coda.stream_backpressure import BackpressureConfig, BackpressurePolicy
from coda.trace import ListTraceSink, check_trace

from .engine_support import tiny_checkpoint

# NOTE: a request nobody reads pauses after its first unread byte (P6 policy 1): it stays
# live, holding its resources, until it is read or cancelled, without spending the CPU
HELD = BackpressureConfig(BackpressurePolicy.PAUSE, pause_bytes=1, max_bytes=1 << 20)


def _req(rid: str | None, max_tokens: int = 300, *, held: bool | None = None
         ) -> GenerationRequest:
    """Held live (paused while unread) by default at the default budget; a short one runs
    to its end unread."""
    held = max_tokens == 300 if held is None else held
    return GenerationRequest((5, 6, 7), SamplingParams(temperature=0.0, ignore_eos=True),
                             max_tokens=max_tokens, request_id=rid,
                             backpressure=HELD if held else None)


@pytest.fixture(scope="module")
def sink() -> ListTraceSink:
    return ListTraceSink()


@pytest.fixture(scope="module")
def engine(sink: ListTraceSink) -> Iterator[AsyncEngine]:
    with AsyncEngine.from_model_dir(tiny_checkpoint(), EngineConfig(num_blocks=128),
                                    trace=sink) as eng:
        yield eng


def _releases(sink: ListTraceSink, rid: str) -> list[str]:
    return [str(e.data["resource"]) for e in list(sink.events)
            if e.request_id == rid and e.kind == tr.RESOURCE_RELEASED]


def _all_free(engine: AsyncEngine, timeout: float = 10.0) -> bool:
    """Every block free and nothing running, once the engine has settled (it frees a request's
    blocks at its safe point, then writes the release rows)."""
    end = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats.num_free_blocks == stats.num_blocks and stats.num_running == 0:
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.02)


def _settled_problems(sink: ListTraceSink, rid: str, timeout: float = 10.0) -> list[str]:
    """``check_trace`` of ``rid``'s rows once they settle (its release rows follow the
    terminal); only this request's: the module's engine reuses ended ids on purpose."""
    end = time.monotonic() + timeout
    while (problems := check_trace(sink.of(rid))) and time.monotonic() < end:
        time.sleep(0.02)
    return problems


async def _first_delta(events: AsyncIterator[StreamEvent]) -> StreamEvent:
    async for ev in events:
        if ev.data:
            return ev
    raise AssertionError("the request ended before its first delta")


def _assert_cancelled_and_released(engine: AsyncEngine, sink: ListTraceSink,
                                   h: RequestHandle) -> None:
    """C1, L7: the abandoned request ended CANCELLED (reason ``cancelled``, not its budget),
    and each of its five resources was released exactly once; every block is back."""
    term = h.wait(20)
    assert term.state is State.CANCELLED and term.finish_reason is FinishReason.CANCELLED
    assert term.usage.selected_tokens < 300
    assert _all_free(engine)
    assert _settled_problems(sink, h.request_id) == []
    assert sorted(_releases(sink, h.request_id)) == sorted(k.value for k in ResourceKind)


# -- one live request per id ------------------------------------------------------------------

def test_c1_p3_a_live_request_id_is_refused_before_anything_is_acquired(
        engine: AsyncEngine, sink: ListTraceSink) -> None:
    """C1, P3: the id of a request still running is refused with DuplicateRequestIdError (an
    InvalidRequestError naming ``request_id``): nothing queued, no stream opened, no trace
    row; ``cancel`` and ``attach`` by id still reach the first. Once it ended, the id is free."""
    first = engine.submit(_req("dup-a"))
    total = engine.num_requests_total
    with pytest.raises(DuplicateRequestIdError) as info:
        engine.submit(_req("dup-a", max_tokens=2))
    assert isinstance(info.value, InvalidRequestError) and info.value.field == "request_id"
    assert "dup-a" in info.value.message
    assert engine.num_requests_total == total
    opened = [e for e in sink.of("dup-a") if e.kind == tr.RESOURCE_ACQUIRED]
    assert len(opened) == len({str(e.data["resource"]) for e in opened})  # NOTE: one request's
    assert engine.log.stream("dup-a") is first.stream and first.stream.terminal is None
    assert engine.cancel("dup-a")
    assert first.wait(20).state is State.CANCELLED
    again = engine.submit(_req("dup-a", max_tokens=2))  # NOTE: ended: the id may be reused
    assert again.wait(20).state is State.FINISHED
    assert engine.log.stream("dup-a") is again.stream


def test_c1_a_batch_naming_one_id_twice_is_refused_whole(engine: AsyncEngine) -> None:
    """C1: ``submit_all`` with one id twice (or the id of a running request) queues none of
    the batch: no stream of it is opened, so no id is left held by a request nobody runs."""
    with pytest.raises(DuplicateRequestIdError):
        engine.submit_all([_req("dup-b1", 2), _req("dup-b2", 2), _req("dup-b1", 2)])
    for rid in ("dup-b1", "dup-b2"):
        with pytest.raises(KeyError):
            engine.attach(rid)
    held = engine.submit(_req("dup-c"))
    with pytest.raises(DuplicateRequestIdError):
        engine.submit_all([_req("dup-d", 2), _req("dup-c", 2)])
    with pytest.raises(KeyError):
        engine.attach("dup-d")
    assert [h.wait(20).state for h in engine.submit_all([_req("dup-b1", 2), _req("dup-d", 2)])] \
        == [State.FINISHED, State.FINISHED]
    assert held.cancel() and held.wait(20).state is State.CANCELLED


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["submit", "end"]), st.sampled_from("xyz")),
                    max_size=12))
def test_c1_property_submit_is_accepted_exactly_when_no_live_request_has_the_id(
        engine: AsyncEngine, ops: list[tuple[str, str]]) -> None:
    """C1 (property): over any sequence of submits and ends of ids from a small pool, a
    submit is accepted exactly when no request with that id is live (the model: a set of
    live ids; every request is held live until it is ended, by cancel)."""
    tag = f"p{id(ops)}-"
    live: dict[str, RequestHandle] = {}
    try:
        for op, name in ops:
            rid = tag + name
            if op == "submit":
                if rid in live:
                    with pytest.raises(DuplicateRequestIdError):
                        engine.submit(_req(rid))
                    assert engine.log.stream(rid) is live[rid].stream
                else:
                    live[rid] = engine.submit(_req(rid))
            elif rid in live:
                assert engine.cancel(rid)
                assert live.pop(rid).wait(20).state is State.CANCELLED
            else:
                assert not engine.cancel(rid)
    finally:
        for h in live.values():
            h.cancel()
            h.wait(20)


# -- the iterator owns the request ------------------------------------------------------------

def _abandon(engine: AsyncEngine, leave: Callable[[RequestHandle], Coroutine[Any, Any, None]],
             rid: str) -> RequestHandle:
    h = engine.submit(_req(rid))
    asyncio.run(leave(h))
    return h


async def _break(h: RequestHandle) -> None:
    async for ev in h.events():
        if ev.data:
            break


async def _aclose(h: RequestHandle) -> None:
    events = h.events()
    await _first_delta(events)
    await events.aclose()


async def _task_cancelled(h: RequestHandle) -> None:
    seen = asyncio.Event()

    async def read() -> None:
        async for ev in h.events():
            if ev.data:
                seen.set()

    task = asyncio.create_task(read())
    await seen.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _collected(h: RequestHandle) -> None:
    events = h.events()
    await _first_delta(events)
    del events
    gc.collect()
    async with asyncio.timeout(20):  # NOTE: the loop closes the collected iterator
        await h.result()


@pytest.mark.parametrize("leave", [_break, _aclose, _task_cancelled, _collected],
                         ids=["break", "aclose", "task-cancelled", "collected"])
def test_p4_c1_l7_leaving_the_event_iterator_cancels_the_request(
        engine: AsyncEngine, sink: ListTraceSink,
        leave: Callable[[RequestHandle], Coroutine[Any, Any, None]]) -> None:
    """P4, C1, L7: the reader of ``handle.events()`` leaves before the terminal: the request
    ends CANCELLED (cause client), its resources each released once, every block back. Before,
    it ran on unread (here: held paused, so it never ended)."""
    h = _abandon(engine, leave, f"own-{leave.__name__}")
    _assert_cancelled_and_released(engine, sink, h)


def test_p3_readers_that_do_not_own_the_request_never_end_it(
        engine: AsyncEngine, sink: ListTraceSink) -> None:
    """P3: ``engine.attach`` (a resume reader) left early, and a ``wait`` that timed out,
    leave the request running; the owner's iterator read to the end sees it FINISHED at its
    budget, and a later ``events`` from past the terminal (or a ``break`` at the terminal)
    cancels nothing."""
    h = engine.submit(_req("keep", max_tokens=12, held=True))

    async def peek() -> None:
        await _first_delta(engine.attach("keep"))

    asyncio.run(peek())
    with pytest.raises(TimeoutError):
        h.wait(0.2)
    assert h.stream.terminal is None

    async def own() -> list[StreamEvent]:
        got = []
        async for ev in h.events():
            got.append(ev)
            if ev.terminal is not None:
                break
        return got

    evs = asyncio.run(own())
    assert evs[-1].terminal is not None and evs[-1].terminal.state is State.FINISHED
    assert evs[-1].terminal.finish_reason is FinishReason.MAX_OUTPUT_TOKENS

    async def past() -> list[StreamEvent]:
        return [ev async for ev in h.events(after=h.stream.last_seq)]

    assert asyncio.run(past()) == []
    assert h.wait(1).finish_reason is FinishReason.MAX_OUTPUT_TOKENS
    assert _settled_problems(sink, "keep") == []
    assert sorted(_releases(sink, "keep")) == sorted(k.value for k in ResourceKind)
