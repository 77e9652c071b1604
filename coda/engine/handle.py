"""The handle of one submitted request: its replayable stream and the one way to cancel it
(SPEC P3, P6, C1). It reads its stream through :mod:`coda.reader`, like every other reader."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable

from coda.finish import CancelCause
from coda.reader import follow, terminal_of, when_closed
from coda.request import RequestRun
from coda.stream import RequestStream, StreamEvent, Terminal


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
        """The terminal, waiting for it (acknowledging what it reads, P6)."""
        return await terminal_of(self.stream)

    def wait(self, timeout: float | None = None) -> Terminal:
        """Blocking wait for the terminal (for synchronous callers)."""
        done = threading.Event()
        remove = when_closed(self.stream, lambda _terminal: done.set())
        try:
            if not done.wait(timeout):
                raise TimeoutError(f"{self.request_id} not finished after {timeout}s")
        finally:
            remove()
        terminal = self.stream.terminal
        assert terminal is not None
        return terminal
