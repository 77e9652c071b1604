"""The engine thread (SPEC L2, L7, C1, T4; issue 3 item 5, issue 11 item 5, issue 24 item 2):
its start (with an at-exit shutdown and the grammar tokenizer's build), its loop (queued
requests admitted and one chunk of an embedding run between steps, the batch stepped while
there is work, each step's end posted to the wake-up channel, the block manager checked when it
goes idle), the embeddings queued to run on it (coda.engine.embed_job: chunked, so they never
hold the thread for a whole long input; dropped at a chunk boundary once their caller
cancelled), and its shutdown: every request still queued or running ends with its one terminal
event (CANCELLED, cause shutdown) and every embedding queued or running is refused. The requests come in through :class:`~coda.engine.async_engine.AsyncEngine`, whose
methods these are.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from coda.engine.embed_job import EmbedJob
from coda.engine.plan import check_embedding_input
from coda.errors import EngineNotStartedError, EngineShutdownError, InvalidRequestError
from coda.finish import CancelCause
from coda.wakeup import CHANNEL

if TYPE_CHECKING:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.engine_request import EngineRequest

log = logging.getLogger("coda.engine")


def start(engine: AsyncEngine) -> None:
    """:meth:`AsyncEngine.start <coda.engine.async_engine.AsyncEngine.start>`."""
    if engine._thread is not None:
        return
    engine._thread = threading.Thread(target=run_loop, args=(engine,), name="coda-engine",
                                      daemon=True)
    engine._thread.start()
    # NOTE: an engine still started at interpreter exit (no shutdown, no `with`) is shut
    # down then, while its thread still runs: left to finalization, the daemon thread was
    # stopped mid-step inside torch's C++ and the process aborted (SIGABRT, exit 134,
    # "terminate called without an active exception"); now its requests end CANCELLED
    engine._at_exit = _shutdown_at_exit(weakref.ref(engine))
    atexit.register(engine._at_exit)
    # NOTE: llguidance is imported by the build, on its thread, not here
    from coda.engine.grammar_tokenizer import warm_ll_tokenizer

    # NOTE: the grammar tokenizer, built off the request path (coda.engine.grammar)
    engine.grammar_warmup = warm_ll_tokenizer(engine.tokenizer, engine.eos_token_ids,
                                              engine.model_name)


def run_loop(engine: AsyncEngine) -> None:
    """The engine thread: per turn, an embedding's next chunk, then the requests queued so
    far admitted (those that arrived during the chunk included), then one step of the batch;
    the block manager checked when it goes idle."""
    checked = True  # NOTE: nothing has run yet
    while True:
        if not checked and not engine.core.has_work:
            check_when_idle(engine)  # NOTE: once per busy -> idle transition
            checked = True
        with engine._cond:
            while (not engine._stopping and not engine._inbox and not engine._calls
                   and engine._embedding is None and not engine.core.has_work):
                engine._cond.wait(0.5)
            if engine._stopping:
                return
        checked = False
        run_calls(engine)
        # NOTE: the inbox is read after the chunk, so a request that arrived while it ran is
        # admitted into this turn's step (read before it, it waited one more chunk)
        with engine._cond:
            incoming = list(engine._inbox)
            engine._inbox.clear()
        for ereq in incoming:
            admit(engine, ereq)
        try:
            engine.stepping = True
            try:
                ran = engine.core.step()
            finally:
                engine.stepping = False
                engine.steps += 1
                CHANNEL.post(engine, engine.steps)  # NOTE: one dict lookup if nobody listens
            if ran == 0 and engine._embedding is None and not engine._calls:
                with engine._cond:  # nothing runnable (paused / out of blocks): don't spin
                    engine._cond.wait(0.005)
        except Exception as exc:  # a bug in the engine itself: fail everyone, keep serving
            log.exception("engine step failed")
            engine.step_error = exc
            engine.core.abort_all(CancelCause.SHUTDOWN)


def check_when_idle(engine: AsyncEngine) -> None:
    """The block manager's bookkeeping invariants, checked each time the engine goes idle
    (every block free or cached, no owner left): O(blocks), only when nothing runs.
    A failure is logged and counted, never raised into the loop (issue 11 item 5)."""
    engine.idle_checks += 1
    try:
        engine.core.scheduler.block_manager.check_integrity()
    except Exception as exc:
        # NOTE: logged before it is counted: whoever waits on the count finds the log
        log.error("KV cache integrity check failed while idle: %s", exc)
        engine.idle_check_failures += 1


def admit(engine: AsyncEngine, ereq: EngineRequest) -> None:
    """Hand a queued request to the core; one its checks refuse ends FAILED (its terminal)."""
    try:
        engine.core.add(ereq)
    except InvalidRequestError as exc:
        ereq.fail(exc)


def shutdown(engine: AsyncEngine, timeout: float) -> None:
    """:meth:`AsyncEngine.shutdown <coda.engine.async_engine.AsyncEngine.shutdown>`."""
    if engine._at_exit is not None:
        atexit.unregister(engine._at_exit)
        engine._at_exit = None
    with engine._cond:
        engine._stopping = True
        engine._cond.notify_all()
    if engine._thread is not None:
        engine._thread.join(timeout)
        engine._thread = None
    _abort_everything(engine)


def embed_future(engine: AsyncEngine, token_ids: list[int]) -> Future[list[float]]:
    """:meth:`AsyncEngine.embed_future <coda.engine.async_engine.AsyncEngine.embed_future>`."""
    ids = list(token_ids)
    check_embedding_input(ids, engine.context_length, engine.limits.vocab_size)
    fut: Future[list[float]] = Future()
    sched = engine.core.scheduler.config
    job = EmbedJob(ids, fut, min(sched.long_prefill_chunk, sched.max_num_batched_tokens))
    with engine._cond:
        if engine._stopping:
            raise EngineShutdownError("the engine is shutting down")
        if engine._thread is None:
            raise EngineNotStartedError("the engine is not started: call engine.start() "
                                        "(or use `with engine:`) before embed")
        engine._calls.append(job)
        engine._cond.notify_all()
    return fut


def run_calls(engine: AsyncEngine) -> None:
    """One chunk of the running embedding (the oldest queued one its caller still waits for
    starts when none runs), between two steps; one whose caller cancelled is dropped with its
    scratch cache at this chunk boundary."""
    while True:
        job = engine._embedding
        if job is None:
            with engine._cond:
                if not engine._calls:
                    return
                job = engine._embedding = engine._calls.popleft()
        if not job.cancelled:
            break
        _drop_cancelled(engine, job)
    engine.embed_chunks += 1
    if job.advance(engine.runner):
        engine._embedding = None


def _drop_cancelled(engine: AsyncEngine, job: EmbedJob) -> None:
    job.release()
    job.future.set_running_or_notify_cancel()  # NOTE: False; wakes concurrent.futures.wait
    engine.embeds_cancelled += 1
    engine._embedding = None


def _abort_everything(engine: AsyncEngine) -> None:
    with engine._cond:
        incoming = list(engine._inbox)
        engine._inbox.clear()
    for ereq in incoming:
        admit(engine, ereq)
    engine.core.abort_all(CancelCause.SHUTDOWN)
    with engine._cond:
        jobs = list(engine._calls)
        engine._calls.clear()
        if engine._embedding is not None:
            jobs.insert(0, engine._embedding)
            engine._embedding = None
    for job in jobs:
        job.answer(EngineShutdownError("the engine is shutting down"))


def _shutdown_at_exit(ref: weakref.ref[AsyncEngine]) -> Callable[[], None]:
    """The ``atexit`` hook of one started engine (held weakly: registering it keeps no engine
    alive): :meth:`AsyncEngine.shutdown`, unregistered by that shutdown when it comes first."""

    def at_exit() -> None:
        engine = ref()
        if engine is not None:
            engine._at_exit = None  # NOTE: nothing to unregister from inside atexit's own run
            engine.shutdown()

    return at_exit
