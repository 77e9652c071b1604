"""Lifecycle graph, terminal critical section and the resources it holds (L1, L2, L3, L7)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable

import pytest

from coda import trace as tr
from coda.errors import ErrorCode
from coda.finish import CancelCause, FinishReason
from coda.lifecycle import (
    TERMINAL_STATES,
    TRANSITIONS,
    DoubleRelease,
    IllegalTransition,
    Lifecycle,
    ResourceKind,
    State,
)
from coda.request import RequestRun
from coda.stream import EventType, RequestStream, StreamClosed
from coda.trace import ListTraceSink, TraceEvent, TraceHandle, check_trace

HAPPY = [State.QUEUED, State.PREFILLING, State.DECODING, State.DRAINING]


def test_l1_happy_path_and_every_illegal_transition_raises() -> None:
    """L1: every pair off the graph raises and changes nothing; L2: a terminal state is never
    left (terminate() from a terminal is a no-op that emits nothing)."""
    sink = ListTraceSink()
    lc = Lifecycle("r", TraceHandle(sink, "r"))
    for s in HAPPY:
        lc.transition(s)
    assert lc.terminate(State.FINISHED, lambda: None)
    seen = [(State(e.data["from"]), State(e.data["to"])) for e in sink.events]
    assert [e.kind for e in sink.events] == [tr.LIFECYCLE] * len(seen)
    assert seen == list(zip([State.CREATED, *HAPPY], [*HAPPY, State.FINISHED], strict=True))
    for frm, to in itertools.product(State, State):
        if to in TRANSITIONS[frm]:
            continue
        probe = Lifecycle("p", state=frm)
        emitted: list[State] = []
        if frm.is_terminal and to in TERMINAL_STATES:
            assert probe.terminate(to, lambda to=to, e=emitted: e.append(to)) is False
        elif to in TERMINAL_STATES:
            with pytest.raises(IllegalTransition):
                probe.terminate(to, lambda to=to, e=emitted: e.append(to))
        else:
            with pytest.raises(IllegalTransition):
                probe.transition(to)
        assert probe.state is frm and emitted == []


def test_l1_each_verb_enters_only_its_own_kind_of_state() -> None:
    """L1, L2: transition() never enters a terminal state, terminate() never a live one, even
    where the graph has the edge."""
    for to in TERMINAL_STATES:
        with pytest.raises(IllegalTransition):
            Lifecycle("x", state=State.DRAINING).transition(to)
    for to in set(State) - TERMINAL_STATES:
        with pytest.raises(IllegalTransition):
            Lifecycle("x", state=State.CREATED).terminate(to, lambda: None)
    lc = Lifecycle("x", state=State.QUEUED)
    assert lc.try_transition(State.PREFILLING) and lc.state is State.PREFILLING
    assert not lc.try_transition(State.QUEUED) and lc.state is State.PREFILLING


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
                ev = stream.delta(b"tail")
                # NOTE: as the output processor does: every delta has its trace row (P2, O1)
                run.trace.record(TraceEvent("r", tr.STREAM_DELTA,
                                            {"seq": ev.seq, "nbytes": 4, "text": "tail"}))
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
    led = Lifecycle("r")
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
    assert run.lifecycle.errors and run.lifecycle.errors[0][0] is ResourceKind.KV_CACHE
    assert "releasing kv_cache failed" in caplog.text
    assert stream.closed and stream.terminal is not None
    assert stream.terminal.finish_reason is FinishReason.EOS


@pytest.fixture
def slow_terminal_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widen the window between "is it terminal?" and the move, so that without the critical
    section two racers would both pass the check (L2)."""

    def slow(self: State) -> bool:
        time.sleep(0.0002)
        return self in TERMINAL_STATES

    monkeypatch.setattr(State, "is_terminal", property(slow))


def _race(n: int, racer: Callable[[int], object]) -> list[BaseException]:
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        barrier.wait()
        try:
            racer(i)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted on
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return errors


@pytest.mark.usefixtures("slow_terminal_check")
def test_l2_racers_all_reach_terminate_and_exactly_one_wins() -> None:
    """L2: four threads call terminate() at once (no gate before it): exactly one returns True,
    the single terminal event is emitted once, the state is the winner's."""
    for start, targets in ((State.DRAINING, [State.FINISHED, State.FAILED]),
                           (State.CANCEL_REQUESTED, [State.CANCELLED]),
                           (State.DECODING, [State.FAILED])):
        for _ in range(40):
            lc = Lifecycle("r", state=start)
            emitted: list[State] = []
            wins: list[State] = []

            def racer(i: int, lc: Lifecycle = lc, emitted: list[State] = emitted,
                      wins: list[State] = wins, targets: list[State] = targets) -> None:
                to = targets[i % len(targets)]
                if lc.terminate(to, lambda: emitted.append(to)):
                    wins.append(to)

            assert _race(4, racer) == []
            assert len(wins) == 1 and emitted == wins and lc.state is wins[0]


@pytest.mark.usefixtures("slow_terminal_check")
def test_l2_l7_racing_endings_of_a_run_yield_one_terminal_and_one_release() -> None:
    """L2, L3, L7: several threads end one DRAINING run at once through RequestRun._end: one
    terminal event, the stream resources released exactly once, a sound trace."""
    for _ in range(40):
        stream = RequestStream("r")
        sink = ListTraceSink()
        run = RequestRun("r", stream, sink, prompt_tokens=1)
        stream.start("m")
        for s in HAPPY:
            run.lifecycle.transition(s)
        # NOTE: a FAILED end carries its error code, as RequestRun.fail gives it (L4)
        endings = [(State.FINISHED, FinishReason.EOS, None),
                   (State.FAILED, FinishReason.MODEL_ERROR, ErrorCode.MODEL_ERROR)]
        errors = _race(4, lambda i, run=run, endings=endings: run._end(*endings[i % 2]))
        assert errors == []
        kinds = [e.type for e in stream.events_after(-1)]
        assert kinds.count(EventType.TERMINAL) == 1 and kinds[-1] is EventType.TERMINAL
        assert check_trace(sink.events) == []


class _GateSink(ListTraceSink):
    """Holds the cancel.requested row until told to go, to expose the check/record window."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.go = threading.Event()

    def record(self, event: TraceEvent) -> None:
        if event.kind == tr.CANCEL_REQUESTED:
            self.entered.set()
            self.go.wait(2)
        super().record(event)


def test_l2_o1_cancel_racing_a_finish_never_records_after_the_terminal() -> None:
    """L2, O1 (defect 8): request_cancel's check and its trace row are one critical section.
    A finish racing it either waits for the row (cancel requested first, a sound trace) or wins
    (the cancel is late: False, nothing recorded) -- never a cancel row after the terminal."""
    sink = _GateSink()
    stream = RequestStream("r")
    run = RequestRun("r", stream, sink, prompt_tokens=1)
    stream.start("m")
    for s in HAPPY[:3]:
        run.lifecycle.transition(s)
    answer: list[bool] = []
    canceller = threading.Thread(target=lambda: answer.append(run.request_cancel()))
    canceller.start()
    assert sink.entered.wait(2)
    finisher = threading.Thread(target=run.finish, args=(FinishReason.EOS,))
    finisher.start()
    time.sleep(0.05)  # NOTE: unguarded, the finisher ends the run inside this window
    sink.go.set()
    canceller.join()
    finisher.join()
    kinds = sink.kinds()
    assert answer == [True] and kinds.index(tr.CANCEL_REQUESTED) < kinds.index(tr.TERMINAL)
    assert check_trace(sink.events) == []


def test_l2_c1_a_late_cancel_returns_false_and_records_nothing() -> None:
    """L2, C1 (defect 8): a cancel while DRAINING (which can only end FINISHED/FAILED) or after
    the terminal returns False and leaves no cancel.requested row."""
    sink = ListTraceSink()
    stream = RequestStream("r")
    run = RequestRun("r", stream, sink, prompt_tokens=1)
    stream.start("m")
    for s in HAPPY:
        run.lifecycle.transition(s)
    assert run.request_cancel() is False and not run.cancel_pending
    run._end(State.FINISHED, FinishReason.EOS)
    assert run.request_cancel() is False
    assert tr.CANCEL_REQUESTED not in sink.kinds() and check_trace(sink.events) == []
    live = RequestRun("q", RequestStream("q"), ListTraceSink(), prompt_tokens=1)
    assert live.request_cancel() is True and live.request_cancel() is False


def test_l7_o1_after_the_trace_handle_is_sealed_lifecycle_rows_are_dropped_and_counted() -> None:
    """L7, O1: the trace handle's release seals it: its own release row is the last written;
    a later state change or acquisition writes no row, each is counted as late."""
    sink = ListTraceSink()
    handle = TraceHandle(sink, "r")
    lc = Lifecycle("r", handle, {ResourceKind.TRACE_HANDLE: handle.close})
    lc.transition(State.QUEUED)
    lc.release(ResourceKind.TRACE_HANDLE)
    assert [e.kind for e in sink.events] == [tr.RESOURCE_ACQUIRED, tr.LIFECYCLE,
                                             tr.RESOURCE_RELEASED]
    assert handle.rows == 3 and handle.late_rows == 0
    lc.transition(State.PREFILLING)
    lc.acquire(ResourceKind.KV_CACHE, lambda: None)
    assert len(sink.events) == 3 and handle.rows == 3 and handle.late_rows == 2


def test_l7_ledger_reports_each_release_and_releases_only_the_kinds_asked() -> None:
    """L7, O1: each kind's release row says ok=True, or ok=False when its clean-up failed, with
    what the release reported; release_all(kinds) leaves the other kinds held."""
    sink = ListTraceSink()
    led = Lifecycle("r", TraceHandle(sink, "r"))

    def boom() -> None:
        raise OSError("gone")

    led.acquire(ResourceKind.KV_CACHE, boom)
    led.acquire(ResourceKind.BATCH_SLOT, lambda: {"slot": 3})
    led.acquire(ResourceKind.STREAM_BUFFER, lambda: None)
    assert [(e.kind, e.data) for e in sink.events] == [
        (tr.RESOURCE_ACQUIRED, {"resource": k}) for k in ("kv_cache", "batch_slot",
                                                          "stream_buffer")]
    assert led.holds(ResourceKind.KV_CACHE) and not led.holds(ResourceKind.RNG_STATE)
    led.release_all((ResourceKind.KV_CACHE, ResourceKind.BATCH_SLOT))
    assert [(e.kind, e.data) for e in sink.events[3:]] == [
        (tr.RESOURCE_RELEASED, {"resource": "kv_cache", "ok": False}),
        (tr.RESOURCE_RELEASED, {"resource": "batch_slot", "ok": True, "slot": 3})]
    assert led.held == {ResourceKind.STREAM_BUFFER} and not led.holds(ResourceKind.KV_CACHE)
    assert led.released == {ResourceKind.KV_CACHE, ResourceKind.BATCH_SLOT}


def test_l7_a_release_runs_outside_the_lifecycle_lock() -> None:
    """L2, L7: the state and the resources share one lock (issue 22: one object), so a
    release function must run after it is let go: one that reads the state under the lock
    (``while_live``) completes, and none of them sees the lock held."""
    lc = Lifecycle("r")
    seen: list[tuple[bool, bool]] = []

    def release() -> None:
        held = lc._lock.locked()  # NOTE: checked first: a held lock would hang while_live
        seen.append((held, not held and lc.while_live(lambda s: s is State.QUEUED)))

    lc.transition(State.QUEUED)
    lc.acquire(ResourceKind.KV_CACHE, release)
    lc.release(ResourceKind.KV_CACHE)
    assert seen == [(False, True)]


def test_l7_o1_birth_rows_are_written_ahead_of_the_first_row_not_at_construction() -> None:
    """L7, O1 (issue 22: building a request never calls back into the trace): the resources
    held from birth are recorded at construction and their acquisition rows written ahead of
    the lifecycle's first other row, in order; a lifecycle that never writes leaves no row."""
    sink = ListTraceSink()
    handle = TraceHandle(sink, "r")
    lc = Lifecycle("r", handle, {ResourceKind.STREAM_BUFFER: lambda: None,
                                 ResourceKind.TRACE_HANDLE: handle.close})
    assert sink.events == [] and lc.held == {ResourceKind.STREAM_BUFFER,
                                             ResourceKind.TRACE_HANDLE}
    lc.transition(State.QUEUED)
    lc.release_all()
    assert [(e.kind, e.data.get("resource", e.data.get("to"))) for e in sink.events] == [
        (tr.RESOURCE_ACQUIRED, "stream_buffer"), (tr.RESOURCE_ACQUIRED, "trace_handle"),
        (tr.LIFECYCLE, "QUEUED"), (tr.RESOURCE_RELEASED, "stream_buffer"),
        (tr.RESOURCE_RELEASED, "trace_handle")]
    assert handle.late_rows == 0
    # NOTE: released before any other row: the birth rows still come first, and the trace
    # handle's release counts them (its close runs after they are written)
    sink2 = ListTraceSink()
    handle2 = TraceHandle(sink2, "s")
    lc2 = Lifecycle("s", handle2, {ResourceKind.TRACE_HANDLE: handle2.close})
    lc2.release(ResourceKind.TRACE_HANDLE)
    assert [(e.kind, dict(e.data)) for e in sink2.events] == [
        (tr.RESOURCE_ACQUIRED, {"resource": "trace_handle"}),
        (tr.RESOURCE_RELEASED, {"resource": "trace_handle", "ok": True, "rows": 1})]
    with pytest.raises(DoubleRelease):
        Lifecycle("x", None, {ResourceKind.KV_CACHE: lambda: None}).acquire(
            ResourceKind.KV_CACHE, lambda: None)


def test_t4_l7_lifecycle_preempt_and_reacquire_alternate_on_a_held_kv_cache() -> None:
    """``Lifecycle.preempt`` / ``reacquire`` write the two rows only in turn and only while the
    ``kv_cache`` resource is held (a preemption of no cache, a resume without a preemption
    or a second preemption raise); after the terminal they write nothing; the resource's own
    rows stay one acquisition and one release (L7)."""
    sink = ListTraceSink()
    lc = Lifecycle("r", TraceHandle(sink, "r"))
    with pytest.raises(IllegalTransition):
        lc.preempt({"t": 0})
    lc.acquire(ResourceKind.KV_CACHE, lambda: None)
    with pytest.raises(IllegalTransition):
        lc.reacquire({"t": 0})
    assert lc.preempt({"t": 0}) and lc.preempted
    with pytest.raises(IllegalTransition):
        lc.preempt({"t": 0})
    assert lc.reacquire({"t": 0, "recompute": 3, "cached": 0}) and not lc.preempted
    lc.transition(State.QUEUED)
    assert lc.terminate(State.FAILED, lambda: None)
    assert lc.preempt({"t": 0}) is False
    lc.release(ResourceKind.KV_CACHE)
    assert [e.kind for e in sink.events] == [
        tr.RESOURCE_ACQUIRED, tr.KV_PREEMPTED, tr.KV_REACQUIRED, tr.LIFECYCLE, tr.LIFECYCLE,
        tr.RESOURCE_RELEASED]
    assert sink.events[1].data == {"t": 0} and sink.events[2].data == {
        "t": 0, "recompute": 3, "cached": 0}
