"""The stream-failure decision: retry or not, and what is billed (SPEC D5).

Seed 004 §4.2's ``decideStreamFailure``: after the first frame (with the policy's
``no_retry_after_first_frame``) never retry; a non-retryable error is not retried; otherwise a
retry is allowed. The committed tokens are billed whatever the decision. The engine asks it when
a model error ends a request (:mod:`coda.engine.core_failures`); the trace checker knows its
reasons (:mod:`coda.trace_rules`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from coda.early_stop_checks import require_bool, require_int


class StreamFailureReason(StrEnum):
    RETRY_ALLOWED = "retry-allowed"
    NO_RETRY_AFTER_FIRST_FRAME = "no-retry-after-first-frame"
    ERROR_NOT_RETRYABLE = "error-not-retryable"


@dataclass(frozen=True, slots=True)
class StreamFailureDecision:
    """D5: ``committed_tokens`` are billed whatever the decision."""

    retryable: bool
    committed_tokens: int
    reason: StreamFailureReason


def decide_stream_failure(
    first_frame_sent: bool,
    error_retryable: bool,
    no_retry_after_first_frame: bool,
    committed_tokens: int,
) -> StreamFailureDecision:
    """D5: after the first frame (with the policy flag) never retry; a non-retryable error is
    not retried; otherwise retry is allowed."""
    committed = require_int(committed_tokens, "committed_tokens", 0)
    sent = require_bool(first_frame_sent, "first_frame_sent")
    retryable = require_bool(error_retryable, "error_retryable")
    no_retry = require_bool(no_retry_after_first_frame, "no_retry_after_first_frame")
    if sent and no_retry:
        return StreamFailureDecision(
            False, committed, StreamFailureReason.NO_RETRY_AFTER_FIRST_FRAME
        )
    if not retryable:
        return StreamFailureDecision(False, committed, StreamFailureReason.ERROR_NOT_RETRYABLE)
    return StreamFailureDecision(True, committed, StreamFailureReason.RETRY_ALLOWED)
