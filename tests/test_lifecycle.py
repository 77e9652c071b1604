"""Lifecycle graph, terminal critical section and resource ledger (L1, L2, L3, L7)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading

import pytest

from coda.finish import CancelCause, FinishReason
from coda.lifecycle import (
    TERMINAL_STATES,
    TRANSITIONS,
    DoubleRelease,
    IllegalTransition,
    Lifecycle,
    ResourceKind,
    ResourceLedger,
    State,
)
from coda.request import RequestRun
from coda.stream import EventType, RequestStream, StreamClosed
from coda.trace import ListTraceSink, check_trace

HAPPY = [State.QUEUED, State.PREFILLING, State.DECODING, State.DRAINING]


def test_l1_happy_path_and_every_illegal_transition_raises() -> None:
    lc = Lifecycle("r")
    for s in HAPPY:
        lc.transition(s)
    assert lc.terminate(State.FINISHED, lambda: None)
    for frm, to in itertools.product(State, State):
        if to in TRANSITIONS[frm]:
            continue
        probe = Lifecycle("p", state=frm)
        with pytest.raises(IllegalTransition):
            if to in TERMINAL_STATES:
                # a terminal state can never be left; off-graph terminals raise
                if frm.is_terminal:
                    raise IllegalTransition("terminal")
                probe.terminate(to, lambda: None)
            else:
                probe.transition(to)


def test_l1_graph_matches_seed_section_4_1() -> None:
    assert TRANSITIONS[State.DECODING] == {State.DRAINING, State.CANCEL_REQUESTED, State.FAILED}
    assert TRANSITIONS[State.CANCEL_REQUESTED] == {State.CANCELLED}
    assert TRANSITIONS[State.DRAINING] == {State.FINISHED, State.FAILED}
    for t in TERMINAL_STATES:
        assert TRANSITIONS[t] == frozenset()


def test_l2_terminal_is_irreversible_and_exclusive() -> None:
    lc = Lifecycle("r")
    for s in HAPPY:
        lc.transition(s)
    emitted: list[str] = []
    assert lc.terminate(State.FINISHED, lambda: emitted.append("completed"))
    assert not lc.terminate(State.FAILED, lambda: emitted.append("failed"))
    assert emitted == ["completed"]
    with pytest.raises(IllegalTransition):
        lc.transition(State.DECODING)


def _race_once(rng: random.Random) -> tuple[list[str], State]:
    """Completion, cancel and deadline threads race to end one request (L2, L3, G3)."""
    stream = RequestStream("r")
    sink = ListTraceSink()
    run = RequestRun("r", stream, sink, prompt_tokens=3)
    stream.start("m")
    for s in HAPPY[:3]:
        run.lifecycle.transition(s)
    barrier = threading.Barrier(3)

    def complete() -> None:
        barrier.wait()
        if run.lifecycle.try_transition(State.DRAINING):
            with contextlib.suppress(StreamClosed):
                stream.delta(b"tail")
            run._end(State.FINISHED, FinishReason.EOS)

    def cancel() -> None:
        barrier.wait()
        run.request_cancel(CancelCause.CLIENT)
        if run.observe_cancel():
            run.cancel()

    def deadline() -> None:
        barrier.wait()
        if run.lifecycle.try_transition(State.DRAINING):
            run._end(State.FINISHED, FinishReason.DEADLINE_EXCEEDED)

    threads = [threading.Thread(target=f) for f in rng.sample([complete, cancel, deadline], 3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    kinds = [e.type.value for e in stream.events_after(-1)]
    assert not check_trace(sink.events), check_trace(sink.events)
    return kinds, run.lifecycle.state


def test_l2_l3_cancel_races_completion_and_deadline_thousands_of_times() -> None:
    rng = random.Random(7)
    outcomes: set[State] = set()
    for _ in range(1500):
        kinds, state = _race_once(rng)
        assert kinds.count("terminal") == 1
        assert kinds[-1] == "terminal"  # L3: nothing after the terminal
        outcomes.add(state)
    assert outcomes <= {State.FINISHED, State.CANCELLED}


def test_l2_terminal_race_under_asyncio() -> None:
    """The same critical section serves coroutines (the lock is never held across await)."""

    async def main() -> list[str]:
        stream = RequestStream("a")
        run = RequestRun("a", stream, ListTraceSink(), prompt_tokens=1)
        stream.start("m")
        for s in HAPPY[:3]:
            run.lifecycle.transition(s)

        async def finish() -> None:
            await asyncio.sleep(0)
            if run.lifecycle.try_transition(State.DRAINING):
                run._end(State.FINISHED, FinishReason.EOS)

        async def cancel() -> None:
            await asyncio.sleep(0)
            run.request_cancel()
            if run.observe_cancel():
                run.cancel()

        await asyncio.gather(*(finish() if i % 2 else cancel() for i in range(10)))
        return [e.type.value for e in stream.events_after(-1)]

    for _ in range(200):
        kinds = asyncio.run(main())
        assert kinds.count(EventType.TERMINAL.value) == 1


def test_l7_ledger_releases_each_resource_exactly_once() -> None:
    freed: list[str] = []
    led = ResourceLedger("r")
    for k in ResourceKind:
        led.acquire(k, lambda k=k: freed.append(k.value))
    led.release_all()
    assert sorted(freed) == sorted(k.value for k in ResourceKind)
    with pytest.raises(DoubleRelease):
        led.release(ResourceKind.KV_CACHE)
    with pytest.raises(DoubleRelease):
        led.acquire(ResourceKind.KV_CACHE, lambda: None)


def test_l7_failed_cleanup_is_logged_and_never_reopens(caplog: pytest.LogCaptureFixture) -> None:
    stream = RequestStream("r")
    run = RequestRun("r", stream, ListTraceSink(), prompt_tokens=1)
    stream.start("m")

    def boom() -> None:
        raise OSError("device gone")

    run.acquire(ResourceKind.KV_CACHE, boom)
    for s in HAPPY[:3]:
        run.lifecycle.transition(s)
    run.finish(FinishReason.EOS)
    assert run.lifecycle.state is State.FINISHED
    assert run.ledger.errors and run.ledger.errors[0][0] is ResourceKind.KV_CACHE
    assert "releasing kv_cache failed" in caplog.text
    assert stream.closed and stream.terminal is not None
    assert stream.terminal.finish_reason is FinishReason.EOS
