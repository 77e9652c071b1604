"""A grammar's native work with a time bound (SPEC S1, L5; "never a hang or a frozen server").

llguidance (1.9.1, the newest) can loop forever computing a token mask: a Lark grammar whose
greedy terminals force an endless output (``A: /a+/`` followed by a terminal that must start
with ``a``: no string of the grammar exists, and the forced bytes ``aaa…`` never end), and none
of its parser limits (lexer fuel, item counts, lexer states) bounds that loop. The call releases
the GIL, so :func:`bounded` runs it on a worker thread of the calling thread's own and waits at
most ``timeout_s``. A call still running then is abandoned, with the matcher it was working on
(:class:`GrammarStuckError`; the caller must never touch that matcher again): native code cannot
be interrupted, so its thread keeps one core busy until the process exits (logged as an error),
and the calling thread gets a fresh worker for its next call. Each calling thread has its own
worker, so one stuck call delays no other thread's grammar work.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from queue import SimpleQueue
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# NOTE: a mask takes microseconds to milliseconds (a large schema's first one ~100 ms); a
# stuck call holds its caller (the engine's step, or an admission) this long, once
MASK_TIMEOUT_S = 3.0


class GrammarStuckError(RuntimeError):
    """The grammar library did not finish a call within its bound; the matcher it was working
    on is lost (still in use by the abandoned call)."""


class _Job(Generic[T]):
    def __init__(self, fn: Callable[[], T]) -> None:
        self.fn = fn
        self.done = threading.Event()
        self.result: T | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # NOTE: re-raised on the caller's thread
            self.error = exc
        finally:
            self.done.set()


class _Worker:
    """One daemon thread running jobs in order for one calling thread."""

    def __init__(self) -> None:
        self.jobs: SimpleQueue[_Job[object]] = SimpleQueue()
        threading.Thread(target=self._run, name="coda-grammar", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.jobs.get().run()


_local = threading.local()


def bounded(fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
    """``fn()``, run on this thread's grammar worker; its exception is raised here. Raises
    :class:`GrammarStuckError` naming ``what`` when it has not returned after ``timeout_s``
    (default :data:`MASK_TIMEOUT_S`, read at the call)."""
    limit = MASK_TIMEOUT_S if timeout_s is None else timeout_s
    worker: _Worker | None = getattr(_local, "worker", None)
    if worker is None:
        worker = _local.worker = _Worker()
    job: _Job[T] = _Job(fn)
    worker.jobs.put(job)  # type: ignore[arg-type]
    if not job.done.wait(limit):
        _local.worker = None  # NOTE: its thread is stuck in native code: never given more work
        log.error("grammar library still computing %s after %.1f s: abandoned (its thread "
                  "keeps a core busy until the process exits)", what, limit)
        raise GrammarStuckError(f"the grammar library did not finish computing {what} within "
                                f"{limit:g} s: a grammar that forces an endless output (a "
                                "greedy terminal such as /a+/ followed by one that must start "
                                "with the same byte) or one too complex to serve")
    if job.error is not None:
        raise job.error
    return job.result  # type: ignore[return-value]
