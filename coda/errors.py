"""Typed errors of Coda (SPEC L4, L5, D1, K3).

Every error a request can end with carries an :class:`ErrorCode`; the HTTP layer maps the
code to a status and the protocol's own error shape. Nothing here imports torch.
"""

from __future__ import annotations

from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request was rejected or ended FAILED. Never free text (L4)."""

    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MODEL_ERROR = "model_error"
    DECODING_ERROR = "decoding_error"
    TRANSPORT_ERROR = "transport_error"
    BACKPRESSURE_OVERFLOW = "backpressure_overflow"
    ENGINE_SHUTDOWN = "engine_shutdown"
    ENGINE_NOT_STARTED = "engine_not_started"
    INTERNAL_ERROR = "internal_error"


class CodaError(Exception):
    """Base of every typed Coda error; ``code`` says which kind."""

    code: ErrorCode = ErrorCode.INTERNAL_ERROR

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequestError(CodaError):
    """A request (or policy) that cannot be accepted; ``field`` names the culprit (D1)."""

    code = ErrorCode.INVALID_REQUEST


class ContextLengthExceededError(InvalidRequestError):
    """The prompt alone does not fit the model's context: rejected before any work."""

    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class DuplicateRequestIdError(InvalidRequestError):
    """``submit`` with the ``request_id`` of a request that is still running (queued or
    generating): refused before anything is acquired, since ``cancel`` and ``attach`` by id
    could reach only one of the two (vLLM refuses it too). An id whose request has ended may
    be used again."""


class ModelNotFoundError(CodaError):
    code = ErrorCode.MODEL_NOT_FOUND


class DecodingError(CodaError):
    """Residual bytes at ``finish()`` that cannot form valid UTF-8 text (K3)."""

    code = ErrorCode.DECODING_ERROR


class ModelError(CodaError):
    """The forward pass (or sampling) failed for a request (L5: never a transport error)."""

    code = ErrorCode.MODEL_ERROR


class BackpressureOverflowError(CodaError):
    """A slow reader let the bounded stream buffer overflow (P6, policy 3)."""

    code = ErrorCode.BACKPRESSURE_OVERFLOW


class EngineShutdownError(CodaError):
    """``submit`` (or ``embed``) on an engine that is shutting down or shut down (its ``with``
    block left): not the request's fault, so no :class:`InvalidRequestError` (it was one);
    over HTTP a 503."""

    code = ErrorCode.ENGINE_SHUTDOWN


class EngineNotStartedError(CodaError):
    """``submit`` on an engine whose loop was never started (``start()`` or ``with``): refused
    at once rather than queued where nothing would ever run it (issue 19 item 4)."""

    code = ErrorCode.ENGINE_NOT_STARTED
