"""The parent side of a model worker process (issue 23 item 1; SPEC P1–P3, P6, C1, L2, L5).

:class:`WorkerProcess` starts one model in its own process (:mod:`coda.engine.process_worker`,
a fresh interpreter) and keeps, per submitted request, a local copy of its stream
(:class:`~coda.engine.process_copy.WorkerCopy`) that the server's readers read as if the engine
were in process. A reader thread receives the
worker's messages and appends each request's events in seq order (``RequestStream.extend``:
a duplicate is skipped, a gap refused), so the stream log's seq numbers are the worker's own.

Exactly one terminal per request, whatever happens to the process:

- the worker's engine ends the request → its terminal arrives like any event;
- the worker refuses it at submit (bad input the engine found) → ``rejected`` → a FAILED
  terminal carrying the engine's error code and message
  (:mod:`coda.engine.process_errors`);
- the process dies (a crash, an OOM kill, SIGKILL) → the pipe closes → every request still
  open on it ends FAILED ``model_error`` naming the model and how the process ended, billed
  as in :func:`coda.engine.local_end.end_failed`.

Billing a request the worker died under (L6, D5): :mod:`coda.engine.local_end`, from the
counts the worker reports with each batch of events and every ``process_sender._REPORT_S``
while tokens move no event.

``close`` refuses a second terminal, so whichever comes first is the one; nothing is appended
after it. Cancel goes to the worker by id; the worker's engine ends the request (C1). An
embedding is a future: cancelled (its client gone), the worker's engine drops it at its next
chunk boundary (:mod:`coda.engine.process_embeds`), as the in-process engine does.
"""

from __future__ import annotations

import itertools
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from coda.engine.local_end import end_failed
from coda.engine.process_embeds import WorkerEmbeds
from coda.engine.process_errors import exit_reason, rebuild_error
from coda.engine.types import EngineConfig, GenerationRequest
from coda.errors import EngineNotStartedError, ErrorCode
from coda.finish import CancelCause, Usage
from coda.stream import RequestStream, StreamClosed, StreamEvent

log = logging.getLogger("coda.engine")


class _Answer:
    """What the pipe reader hands one waiting caller: ``value`` once the worker answered.
    ``event`` set with ``answered`` false means no value comes (a submit accepted, or the
    worker gone)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.answered = False
        self.value: object = None

    def give(self, value: object) -> None:
        self.value, self.answered = value, True
        self.event.set()
_VALIDATE_WAIT_S = 10.0


class WorkerProcess:
    """One model's worker process, seen from the server (see the module docstring).

    ``state``: ``loading`` → ``ready`` → ``exited``, or ``loading`` → ``failed``. ``settled``
    is set once it is no longer ``loading``. ``on_exit(worker)`` is called once, from the
    reader thread, when the process is gone (or failed to load)."""

    def __init__(self, name: str, model: str | None, config: EngineConfig, *,
                 kv_available: int | None = None,
                 log_setup: Callable[[], None] | None = None,
                 on_exit: Callable[[WorkerProcess], None] | None = None) -> None:
        self.name = name
        self.model, self.config, self.kv_available = model, config, kv_available
        self.on_exit = on_exit
        self.log_setup = log_setup
        self.state = "loading"
        self.error: str | None = None
        self.info: dict[str, Any] = {}
        self.settled = threading.Event()
        self.started_at = time.monotonic()
        self.load_s: float | None = None
        self._open: dict[str, tuple[RequestStream, int]] = {}
        self._reported: dict[str, Usage] = {}  # NOTE: each open request's last billing report
        self._lock = threading.Lock()  # NOTE: guards _open and state
        # NOTE: a separate lock for the pipe: the reader never waits behind a blocked send
        self._send_lock = threading.Lock()
        self._calls: dict[int, _Answer] = {}
        self._embeds = WorkerEmbeds(  # NOTE: embeddings not answered yet
            lambda call_id, ids: self._send(("call", call_id, "embed", (ids,))),
            lambda call_id: self._send(("cancel_call", call_id)))
        self._waits: dict[str, _Answer] = {}  # NOTE: submits waiting for accepted/rejected
        self._ids = itertools.count()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> WorkerProcess:
        """Start the process (``python -m coda.engine.process_worker FD``: a fresh
        interpreter that imports nothing of the server's main module) and its reader."""
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "coda.engine.process_worker", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        theirs.close()
        self._conn = Connection(ours.detach())
        self._send(("init", self.model, self.config, self.kv_available, self.log_setup))
        threading.Thread(target=self._read, name=f"coda-worker-{self.name}",
                         daemon=True).start()
        return self

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self, timeout: float = 30.0) -> None:
        """Ask the worker to end (its engine ends every request it holds, cause shutdown,
        and their terminals come back), then wait; kill it past ``timeout``."""
        self._send(("shutdown",))
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self.settled.wait(5)

    def kill(self) -> None:
        """SIGKILL the process (tests; what the kernel's OOM killer does)."""
        if self._proc is not None:
            self._proc.kill()

    # -- requests ------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, stream: RequestStream, *,
               validate: bool = False) -> None:
        """Send ``req`` (its ``request_id`` set) to the worker; its events go to ``stream``.
        A worker already gone ends ``stream`` at once (FAILED). A request the worker's engine
        refuses ends FAILED with the engine's error code — or, with ``validate``, raises that
        error here (what the in-process engine's ``submit`` raises: the server's 400): the
        call then waits for the worker's answer (a pipe round trip)."""
        rid = req.request_id
        assert rid is not None
        waiter = _Answer()
        with self._lock:
            alive = self.state == "ready"
            if alive:
                self._open[rid] = (stream, len(req.prompt_token_ids))
                if validate:
                    self._waits[rid] = waiter
        if not alive or not self._send(("submit", req, validate)):
            self._forget(rid)
            end_failed(stream, self.name, len(req.prompt_token_ids),
                       f"model worker '{self.name}' is not running ({self.error or self.state})")
            return
        if not validate:
            return
        # NOTE: bounded; past it (or if the worker dies) the stream's own ending applies
        waiter.event.wait(_VALIDATE_WAIT_S)
        with self._lock:
            self._waits.pop(rid, None)
        if waiter.answered:
            self._forget(rid)
            assert isinstance(waiter.value, Exception)
            raise waiter.value

    def cancel(self, request_id: str, cause: CancelCause) -> None:
        self._send(("cancel", request_id, cause.value))

    def ack(self, request_id: str, seq: int) -> None:
        self._send(("ack", request_id, seq))

    def call(self, method: str, *args: object, timeout: float = 10.0) -> Any:
        """A blocking call answered by the worker (``stats``, ``trace_rows``); TimeoutError if
        no answer (e.g. the worker died)."""
        slot = _Answer()
        call_id = next(self._ids)
        self._calls[call_id] = slot
        try:
            if (not self._send(("call", call_id, method, args)) or not slot.event.wait(timeout)
                    or not slot.answered):
                raise TimeoutError(f"model worker '{self.name}' did not answer {method}")
            return slot.value
        finally:
            self._calls.pop(call_id, None)

    def embed(self, token_ids: list[int]) -> Future[list[float]]:
        """The worker engine's :meth:`~coda.engine.async_engine.AsyncEngine.embed_future`
        (:mod:`coda.engine.process_embeds`: cancel the future to stop it at its next chunk)."""
        return self._embeds.start(next(self._ids), token_ids, self._embed_lost)

    @property
    def num_open(self) -> int:
        return len(self._open)

    # -- internals -----------------------------------------------------------------------
    def _send(self, msg: tuple[object, ...]) -> bool:
        if self._conn is None:
            return False
        try:
            with self._send_lock:
                self._conn.send(msg)
            return True
        except (OSError, ValueError, BrokenPipeError):  # NOTE: the process is gone
            return False

    def _embed_lost(self) -> EngineNotStartedError:
        return EngineNotStartedError(f"model worker '{self.name}' did not answer the "
                                     f"embedding ({self.error or self.state})")

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._open.pop(rid, None)
            self._reported.pop(rid, None)

    def _read(self) -> None:
        assert self._conn is not None
        try:
            while True:
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            pass
        except Exception:  # NOTE: a bug here must still end the requests, never hang them
            log.exception("model worker reader failed", extra={"model": self.name})
            self.kill()
        self._gone()

    def _dispatch(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "events":
            for rid, evs in msg[1]:
                self._deliver(rid, evs)
            with self._lock:  # NOTE: after the events they go with (the module docstring)
                for rid, usage in msg[2]:
                    if rid in self._open:
                        self._reported[rid] = usage
        elif kind == "rejected":
            _, rid, kind_, code, message, field = msg
            with self._lock:
                waiter = self._waits.pop(rid, None)
                entry = self._open.pop(rid, None) if waiter is None else None
            if waiter is not None:
                waiter.give(rebuild_error(kind_, code, message, field))
            elif entry is not None:
                end_failed(entry[0], self.name, entry[1], message, ErrorCode(code))
        elif kind == "accepted":
            with self._lock:
                waiter = self._waits.pop(msg[1], None)
            if waiter is not None:
                waiter.event.set()
        elif kind == "reply" and self._embeds.owns(msg[1]):
            self._embeds.answer(msg[1], msg[2])
        elif kind == "reply":
            slot = self._calls.get(msg[1])
            if slot is not None:
                slot.give(msg[2])
        elif kind == "loaded":
            self.info, self.state = msg[1], "ready"
            self.load_s = time.monotonic() - self.started_at
            self.settled.set()
        elif kind == "load_failed":
            self.error, self.state = msg[1], "failed"
            self.settled.set()

    def _deliver(self, rid: str, evs: list[StreamEvent]) -> None:
        with self._lock:
            entry = self._open.get(rid)
        if entry is None:
            return
        stream = entry[0]
        try:
            stream.extend(evs)
        except (StreamClosed, ValueError):
            # NOTE: ended here first (the process died while this batch was in flight)
            log.warning("events after the request's end dropped", extra={"request_id": rid})
        if stream.closed:
            self._forget(rid)

    def _gone(self) -> None:
        """The pipe closed: the process ended. Every open request ends FAILED, once."""
        code = None
        if self._proc is not None:
            try:
                code = self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait(5)
        why = exit_reason(code)
        with self._lock:
            if self.state == "loading":
                self.state, self.error = "failed", f"the worker {why} while loading"
            elif self.state == "ready":
                self.state, self.error = "exited", f"the worker {why}"
            open_, self._open = self._open, {}
            reported, self._reported = self._reported, {}
        self.settled.set()
        if self.on_exit is not None:  # NOTE: first: once a request has ended, it is counted
            self.on_exit(self)
        for rid, (stream, prompt_tokens) in open_.items():
            if not stream.closed:
                end_failed(stream, self.name, prompt_tokens,
                           f"model worker '{self.name}' {why}", reported=reported.get(rid))
        for slot in [*self._calls.values(), *self._waits.values()]:
            slot.event.set()  # NOTE: unanswered calls time out at once (no value given)
        self._embeds.fail_all(self._embed_lost)
