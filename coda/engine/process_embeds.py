"""The embeddings a model worker has yet to answer, seen from the server (issue 23 item 1;
SPEC C1, L7; :class:`~coda.engine.process_engine.WorkerProcess` holds one).

Each is a :class:`~concurrent.futures.Future`, like the in-process engine's
(:meth:`~coda.engine.async_engine.AsyncEngine.embed_future`): the worker's reply settles it (the
vector, or the refusal re-raised as the exception the worker's engine raised); cancelled by its
caller (the awaiting task cancelled, its HTTP client gone), it is forgotten here and
``cancel_call`` goes to the worker (the messages: :mod:`coda.engine.process_worker`), whose engine drops the embedding at its next
chunk boundary (:mod:`coda.engine.embed_job`), so the model's engine loop is free at once, as
with one model. A worker that dies fails every one still open (EngineNotStartedError: 503).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from typing import Any

from coda.engine.process_errors import rebuild_error


class WorkerEmbeds:
    """The open embedding calls of one worker, by call id. ``send_embed(call_id, token_ids)``
    and ``send_cancel(call_id)`` put the protocol's messages on the worker's pipe (built where
    every message to the worker is, :class:`~coda.engine.process_engine.WorkerProcess`; False:
    the process is gone)."""

    def __init__(self, send_embed: Callable[[int, list[int]], bool],
                 send_cancel: Callable[[int], bool]) -> None:
        self._send_embed, self._send_cancel = send_embed, send_cancel
        self._open: dict[int, Future[list[float]]] = {}
        self._lock = threading.Lock()  # NOTE: the event loop, the pipe reader and callbacks

    def start(self, call_id: int, token_ids: list[int],
              lost: Callable[[], BaseException]) -> Future[list[float]]:
        """Send embedding ``call_id`` of ``token_ids``; its future (failed with ``lost()`` at
        once if the worker is gone)."""
        fut: Future[list[float]] = Future()
        with self._lock:
            self._open[call_id] = fut
        fut.add_done_callback(lambda f: self._done(call_id, f))
        if not self._send_embed(call_id, token_ids):
            self.answer(call_id, lost())
        return fut

    def owns(self, call_id: int) -> bool:
        with self._lock:
            return call_id in self._open

    def answer(self, call_id: int, answer: Any) -> None:
        """Settle ``call_id`` with the worker's reply (``("ok", vector)`` or a refusal's
        fields) or an exception, unless its caller cancelled it."""
        with self._lock:
            fut = self._open.pop(call_id, None)
        if fut is None:
            return  # NOTE: cancelled: the worker's reply crossed the cancel
        with contextlib.suppress(InvalidStateError):  # NOTE: cancelled since the pop
            if isinstance(answer, BaseException):
                fut.set_exception(answer)
            elif answer[0] != "ok":
                fut.set_exception(rebuild_error(*answer))
            else:
                fut.set_result(answer[1])

    def fail_all(self, exc: Callable[[], BaseException]) -> None:
        """The worker is gone: every open call fails with ``exc()``."""
        with self._lock:
            ids = list(self._open)
        for call_id in ids:
            self.answer(call_id, exc())

    def _done(self, call_id: int, fut: Future[list[float]]) -> None:
        if not fut.cancelled():
            return
        with self._lock:
            was_open = self._open.pop(call_id, None) is not None
        if was_open:
            self._send_cancel(call_id)  # NOTE: its caller left (C1)
