"""The handle of one submitted request: its replayable stream and the one way to cancel it
(SPEC P3, P6, C1). It reads its stream through :mod:`coda.reader`, like every other reader."""

from __future__ import annotations

from collections.abc import Callable

from coda.finish import CancelCause
from coda.reader import StreamReading, wait_terminal
from coda.request import RequestRun
from coda.stream import RequestStream, Terminal


class RequestHandle(StreamReading):
    """A submitted request: its stream (read through :class:`coda.reader.StreamReading`), and
    the one way to cancel it."""

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

    def wait(self, timeout: float | None = None) -> Terminal:
        """Blocking wait for the terminal (for synchronous callers; no event loop needed)."""
        terminal = wait_terminal(self.stream, timeout)
        if terminal is None:
            raise TimeoutError(f"{self.request_id} not finished after {timeout}s")
        return terminal
