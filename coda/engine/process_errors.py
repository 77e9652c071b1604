"""A model worker's refusal and its end, in the parent's terms (issue 23 item 1; SPEC L2, L5).

A request the worker's engine refuses comes back as plain data (kind, code, message, field):
:func:`rebuild_error` makes it the exception the in-process engine's ``submit`` raises (the
server's 400 / 503). A process that ended is named by :func:`exit_reason` in the ``model_error``
terminal of every request still open on it (:mod:`coda.engine.process_engine`).
"""

from __future__ import annotations

import signal

from coda.errors import (
    CodaError,
    ContextLengthExceededError,
    EngineShutdownError,
    ErrorCode,
    InvalidRequestError,
)

__all__ = ["exit_reason", "rebuild_error"]


def rebuild_error(kind: str, code: str, message: str, field: str | None) -> Exception:
    """The worker engine's refusal as the exception its ``submit`` raised (by kind)."""
    if kind == "value":
        return ValueError(message)
    cls = {ErrorCode.INVALID_REQUEST.value: InvalidRequestError,
           ErrorCode.CONTEXT_LENGTH_EXCEEDED.value: ContextLengthExceededError,
           ErrorCode.ENGINE_SHUTDOWN.value: EngineShutdownError}.get(code)
    if cls is not None:
        return cls(message, field=field)
    err = CodaError(message, field=field)
    err.code = ErrorCode(code)
    return err


def exit_reason(code: int | None) -> str:
    """How a process ended, in words (a negative code is the signal that killed it)."""
    if code is None:
        return "stopped responding"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"
