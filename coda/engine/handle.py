"""The handle of one submitted request: its replayable stream and the one way to cancel it
(SPEC P3, P6, C1)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable

from coda.finish import CancelCause
from coda.request import RequestRun
from coda.stream import EventType, RequestStream, StreamEvent, Terminal


class RequestHandle:
    """A submitted request: its stream, and the one way to cancel it."""

    def __init__(self, run: RequestRun, wake_engine: Callable[[], None]) -> None:
        self._run = run
        self._wake = wake_engine
        self.request_id = run.request_id
        self.stream: RequestStream = run.stream
        self.prompt_tokens: int = run.prompt_tokens

    def cancel(self, cause: CancelCause = CancelCause.CLIENT) -> bool:
        """Request a cancel (C1 moment 1); the engine observes it at its next safe point."""
        ok = self._run.request_cancel(cause)
        self._wake()
        return ok

    def events(self, after: int = -1) -> AsyncIterator[StreamEvent]:
        """Replay events after ``after`` then follow live ones; ends after the terminal (P3).
        Replaying from at or past the terminal's sequence number yields nothing and returns at
        once. Acknowledges what it yields, which frees backpressure credit (P6)."""
        return follow(self.stream, after)

    async def result(self) -> Terminal:
        # NOTE: resume one event early, so a stream that is already closed yields its terminal
        async for ev in self.events(self.stream.last_seq - 1):
            if ev.terminal is not None:
                return ev.terminal
        terminal = self.stream.terminal
        assert terminal is not None
        return terminal

    def wait(self, timeout: float | None = None) -> Terminal:
        """Blocking wait for the terminal (for synchronous callers)."""
        done = threading.Event()
        remove = self.stream.add_listener(lambda: done.set() if self.stream.closed else None)
        try:
            if not self.stream.closed and not done.wait(timeout):
                raise TimeoutError(f"{self.request_id} not finished after {timeout}s")
        finally:
            remove()
        terminal = self.stream.terminal
        assert terminal is not None
        return terminal


async def follow(stream: RequestStream, after: int = -1) -> AsyncIterator[StreamEvent]:
    """Replay ``stream`` after ``after``, then follow it live until its terminal (P3);
    acknowledges each event it yields (P6). The one in-process reader of a stream log."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def on_append() -> None:
        # NOTE: the reader's loop may be closed already; then there is nothing to wake
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(wake.set)

    remove = stream.add_listener(on_append)
    seq = after
    try:
        while True:
            # NOTE: read "closed" before the log: a closed log read afterwards is complete
            closed = stream.closed
            batch = stream.events_after(seq)
            for ev in batch:
                yield ev
                seq = ev.seq
                stream.ack(seq)
                if ev.type is EventType.TERMINAL:
                    return
            if not batch:
                if closed:
                    return  # NOTE: resumed at or past the terminal: nothing is left
                await wake.wait()
                wake.clear()
    finally:
        remove()
