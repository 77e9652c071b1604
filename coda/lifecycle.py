"""Request lifecycle: states, the legal transition graph, the terminal critical section and
the resources held, in one :class:`Lifecycle` per request (SPEC L1, L2, L3, L7; seed 000 §4.1, §4.3, §4.10).

Graph (seed §4.1), with the two additions the state table implies::

    CREATED -> QUEUED -> PREFILLING -> DECODING -> DRAINING -> FINISHED
                  |          |             |           |
                  +----------+-------------+-----------+--> FAILED
                  |          |             |
                  +----------+-------------+--> CANCEL_REQUESTED -> CANCELLED

- CREATED -> FAILED: a request rejected at validation ("reject" in the table).
- QUEUED/PREFILLING -> DRAINING: a deadline that fires before decoding ("timeout" in the table)
  takes the same drain path as a deadline during decoding, so it ends FINISHED with
  deadline_exceeded and is never reported as cancelled (G3).

All transitions of one request happen under one lock. Fixing a terminal state and queueing the
single terminal event happen in the same critical section (L2), so a cancel racing a normal
completion yields exactly one terminal. The lock is a ``threading.Lock`` that is never held
across an ``await``, so it is safe under threads and asyncio alike. The resources share it:
a release function runs after the lock is let go, so it may never deadlock on its own request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import InitVar, dataclass, field
from enum import StrEnum

from coda import trace as tr
from coda.trace import TraceHandle

log = logging.getLogger("coda.lifecycle")


class State(StrEnum):
    CREATED = "CREATED"
    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    DECODING = "DECODING"
    DRAINING = "DRAINING"
    FINISHED = "FINISHED"
    CANCEL_REQUESTED = "CANCEL_REQUESTED"
    CANCELLED = "CANCELLED"
    FAILED = "FAILED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({State.FINISHED, State.CANCELLED, State.FAILED})

TRANSITIONS: dict[State, frozenset[State]] = {
    State.CREATED: frozenset({State.QUEUED, State.FAILED}),
    State.QUEUED: frozenset(
        {State.PREFILLING, State.DRAINING, State.CANCEL_REQUESTED, State.FAILED}
    ),
    State.PREFILLING: frozenset(
        {State.DECODING, State.DRAINING, State.CANCEL_REQUESTED, State.FAILED}
    ),
    State.DECODING: frozenset({State.DRAINING, State.CANCEL_REQUESTED, State.FAILED}),
    State.DRAINING: frozenset({State.FINISHED, State.FAILED}),
    State.CANCEL_REQUESTED: frozenset({State.CANCELLED}),
    State.FINISHED: frozenset(),
    State.CANCELLED: frozenset(),
    State.FAILED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A transition outside the §4.1 graph (L1), or out of a terminal state (L2)."""


class ResourceKind(StrEnum):
    KV_CACHE = "kv_cache"
    BATCH_SLOT = "batch_slot"
    RNG_STATE = "rng_state"
    STREAM_BUFFER = "stream_buffer"
    TRACE_HANDLE = "trace_handle"


# A release function; it may return what it freed, for the trace row (see Lifecycle).
Release = Callable[[], "Mapping[str, object] | None"]


class DoubleRelease(RuntimeError):
    """A resource released twice: the design makes this impossible; raising proves it (L7)."""


@dataclass
class Lifecycle:
    """The state of one request and the resources it holds, under one lock (L1, L2, L7).

    Every state change goes through :meth:`transition` or :meth:`terminate`. Every resource is taken with
    :meth:`acquire` and given back exactly once with :meth:`release`: the entry is popped
    before its release function runs, so a second release of the same kind raises
    :class:`DoubleRelease` instead of freeing twice. A release function that fails is logged as
    a background error (``errors`` keeps them) and never reopens the request. A release
    function may return what it freed (a small mapping, e.g. ``{"unacked_bytes": 12}``), which
    the release's trace row reports with the outcome.

    The lifecycle writes its own facts to the request's ``trace`` handle (O1): a ``lifecycle``
    row per state change (inside the critical section, so it precedes any racing terminal),
    and a row per acquisition and per release; the trace handle's own release row is its
    last (it seals the handle). ``holding``: the resources the request holds from its first
    moment (the run's stream buffer and trace handle), acquired at construction; their rows
    are written ahead of the lifecycle's first other row (its first state change or release,
    on the driver's thread), so building a request writes nothing to the trace and the data
    goes one way: the builder hands the handle over, only the driver's calls write through it
    (issue 22: admission never calls back into ``coda.trace``). The rows keep their order.

    The five resource kinds and who releases what (nothing here is a placeholder):

    - ``kv_cache``: the sequence's blocks back to the block manager (engine) or the model's
      cache (reference loop);
    - ``batch_slot``: the request's entry in the engine's running set;
    - ``rng_state``: the request's counter-RNG cursor (seed, step) that every sampling row
      reads; released, it refuses further reads (coda.engine.engine_request.EngineRequest.rng_seed);
    - ``stream_buffer``: the stream's live delivery: its backpressure credit and its listeners
      (the replay log itself stays, for resume, P3; :meth:`coda.stream.RequestStream.release_live`);
    - ``trace_handle``: the request's binding to the trace sink, sealed last
      (:class:`coda.trace.TraceHandle`).

    One object, not a lifecycle and a ledger forwarding to each other (issue 22): the state
    and the resources are the same request's, and both are read by its one run.
    """

    request_id: str
    trace: TraceHandle | None = None
    holding: InitVar[Mapping[ResourceKind, Release] | None] = None
    state: State = State.CREATED
    errors: list[tuple[ResourceKind, BaseException]] = field(default_factory=list)
    _held: dict[ResourceKind, Release] = field(default_factory=dict)
    _released: set[ResourceKind] = field(default_factory=set)
    _born: list[ResourceKind] = field(default_factory=list)  # NOTE: rows not yet written
    _preempted: bool = False  # NOTE: K/V dropped by a preemption, not yet reacquired (T4)
    _born_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self, holding: Mapping[ResourceKind, Release] | None) -> None:
        self._held.update(holding or {})
        self._born.extend(holding or {})

    def transition(self, to: State) -> None:
        """Move to a non-terminal state; raises IllegalTransition off the graph (L1)."""
        if to in TERMINAL_STATES:
            raise IllegalTransition(f"use terminate() to enter {to.value}")
        with self._lock:
            self._move(to)

    def try_transition(self, to: State) -> bool:
        """Like :meth:`transition` but returns False instead of raising when ``to`` is not
        reachable now (used where a racing terminal may already have won)."""
        with self._lock:
            if to not in TRANSITIONS[self.state]:
                return False
            self._move(to)
            return True

    def terminate(self, to: State, emit_terminal: Callable[[], None]) -> bool:
        """Fix terminal state ``to`` and queue the single terminal event atomically (L2).

        Returns False, changing nothing, if the request is already terminal: the loser of a
        race (cancel vs completion, deadline vs both) is a no-op. Raises IllegalTransition if
        ``to`` is not reachable from a non-terminal state.
        """
        if to not in TERMINAL_STATES:
            raise IllegalTransition(f"{to.value} is not a terminal state")
        with self._lock:
            if self.state.is_terminal:
                return False
            self._move(to)
            # NOTE: emitted while still holding the lock, so no other terminal can interleave.
            emit_terminal()
            return True

    def while_live(self, fn: Callable[[State], bool]) -> bool:
        """Run ``fn(state)`` inside the critical section unless the request is terminal, and
        return its answer (False if terminal). A check and what it records then cannot be
        split by a racing :meth:`terminate` (L2, O1)."""
        with self._lock:
            if self.state.is_terminal:
                return False
            return fn(self.state)

    @property
    def is_terminal(self) -> bool:
        return self.state.is_terminal

    def _move(self, to: State) -> None:
        frm = self.state
        if to not in TRANSITIONS[frm]:
            raise IllegalTransition(f"{self.request_id}: {frm.value} -> {to.value} is not legal")
        self.state = to
        self._row(tr.LIFECYCLE, {"from": frm.value, "to": to.value})

    # -- resources (L7) -------------------------------------------------------------------
    def acquire(self, kind: ResourceKind, release: Release) -> None:
        with self._lock:
            if kind in self._held or kind in self._released:
                raise DoubleRelease(f"{self.request_id}: {kind.value} acquired twice")
            self._held[kind] = release
        self._row(tr.RESOURCE_ACQUIRED, {"resource": kind.value})

    def holds(self, kind: ResourceKind) -> bool:
        return kind in self._held

    def preempt(self, data: Mapping[str, object]) -> bool:
        """The scheduler dropped the request's K/V blocks (T4, preemption by recompute): a
        ``kv.preempted`` row. The ``kv_cache`` resource stays held (the request keeps its
        claim on the cache and is released once, at its ending, L7); :meth:`reacquire` says
        when it has blocks again. False, writing nothing, if the request is terminal."""
        return self._kv_row(tr.KV_PREEMPTED, data, preempted=True)

    def reacquire(self, data: Mapping[str, object]) -> bool:
        """The preempted request got blocks again and recomputes (``recompute`` tokens): a
        ``kv.reacquired`` row, before any other row of its model (T4, O1)."""
        return self._kv_row(tr.KV_REACQUIRED, data, preempted=False)

    @property
    def preempted(self) -> bool:
        return self._preempted

    def _kv_row(self, kind: str, data: Mapping[str, object], *, preempted: bool) -> bool:
        with self._lock:
            if self.state.is_terminal:
                return False
            if ResourceKind.KV_CACHE not in self._held or self._preempted is preempted:
                raise IllegalTransition(f"{self.request_id}: {kind} while the K/V is "
                                        f"{'dropped' if self._preempted else 'held'}")
            self._preempted = preempted
            self._row(kind, data)  # NOTE: in the critical section, as a transition's row
            return True

    def release(self, kind: ResourceKind) -> None:
        self._write_born()  # NOTE: before the release function (the trace handle's counts rows)
        with self._lock:
            if kind not in self._held:
                raise DoubleRelease(f"{self.request_id}: {kind.value} is not held")
            fn = self._held.pop(kind)
            self._released.add(kind)
        # NOTE: outside the lock: a release function may read the state (never re-enter it)
        ok = True
        detail: Mapping[str, object] = {}
        try:
            detail = fn() or {}
        except Exception as exc:  # L7: log, never reopen
            ok = False
            self.errors.append((kind, exc))
            log.error("request %s: releasing %s failed: %r", self.request_id, kind.value, exc)
        # NOTE: the sealed trace handle's own release row is its last
        self._row(tr.RESOURCE_RELEASED, {"resource": kind.value, "ok": ok, **detail},
                  last=kind is ResourceKind.TRACE_HANDLE)

    def release_all(self, kinds: tuple[ResourceKind, ...] | None = None) -> None:
        """Release every held resource of ``kinds`` (all if None), in acquisition order."""
        for kind in list(self._held):
            if kinds is None or kind in kinds:
                self.release(kind)

    @property
    def held(self) -> frozenset[ResourceKind]:
        return frozenset(self._held)

    @property
    def released(self) -> frozenset[ResourceKind]:
        return frozenset(self._released)

    def _write_born(self) -> None:
        """The acquisition rows of the resources held from birth, once, ahead of any other."""
        # NOTE: its own lock: a row may be written inside the critical section (_move)
        with self._born_lock:
            born, self._born = self._born, []
            for kind in born:
                if self.trace is not None:
                    self.trace.emit(tr.RESOURCE_ACQUIRED, {"resource": kind.value})

    def record(self, kind: str, data: Mapping[str, object]) -> None:
        """A row about the request (a cancel's moments, its terminal), after the birth rows."""
        self._row(kind, data)

    def _row(self, kind: str, data: Mapping[str, object], *, last: bool = False) -> None:
        self._write_born()
        if self.trace is not None:
            self.trace.emit(kind, data, last=last)
