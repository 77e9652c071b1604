"""Finish reasons and usage (SPEC L4, L5, L6).

The finish reason is an enum, never free text (L4). The enum is versioned: a member added
later bumps :data:`FINISH_REASON_VERSION` and is documented here.

Version history
- 1: the ten reasons of seed 000 §4.10.
- 2: ``confidence_stop`` — an early stop by confidence (seed 004, SPEC D2). Deadline and user
  cancel keep their own reasons (deadline_exceeded, cancelled).
- 3: ``grammar_forced_close`` — structured output steered to a short completion because the
  budget (max tokens or context) was about to run out mid-structure (issue 13; a natural end on
  the wire, never reported as a truncation). Also when the budget ends exactly as the grammar
  accepts, with closure on.

The version is emitted with every ending — the terminal event, the API's ``coda`` object and
the trace's terminal row — beside the stop tie-rule version (S4,
:data:`coda.stops.STOP_RULE_VERSION`), and ``coda trace check`` verifies both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum

FINISH_REASON_VERSION = 3


class FinishReason(StrEnum):
    EOS = "eos"
    STOP_SEQUENCE = "stop_sequence"
    GRAMMAR_COMPLETE = "grammar_complete"
    MAX_OUTPUT_TOKENS = "max_output_tokens"
    CONTEXT_LIMIT = "context_limit"
    CANCELLED = "cancelled"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CONTENT_INTERRUPTED = "content_interrupted"
    MODEL_ERROR = "model_error"
    TRANSPORT_ERROR = "transport_error"
    # version 2
    CONFIDENCE_STOP = "confidence_stop"
    # version 3
    GRAMMAR_FORCED_CLOSE = "grammar_forced_close"


# Every version's members (values), so a recorded (version, reason) pair can be checked (L4).
REASONS_BY_VERSION: dict[int, frozenset[str]] = {
    1: frozenset(r.value for r in FinishReason if r not in (
        FinishReason.CONFIDENCE_STOP, FinishReason.GRAMMAR_FORCED_CLOSE)),
    2: frozenset(r.value for r in FinishReason if r is not FinishReason.GRAMMAR_FORCED_CLOSE),
    3: frozenset(r.value for r in FinishReason),
}


class CancelCause(StrEnum):
    """Who asked for a cancel; decides the reported reason (L5, P4, G3)."""

    CLIENT = "client"          # an explicit cancel call -> cancelled
    DISCONNECT = "disconnect"  # the transport went away (declared policy) -> transport_error
    SHUTDOWN = "shutdown"      # the server is stopping -> cancelled
    BACKPRESSURE = "backpressure"  # a reader too slow past the bound -> transport_error
    # the early-stop policy (D6) -> the policy's own reason, which the run carries
    EARLY_STOP = "early_stop"

    @property
    def finish_reason(self) -> FinishReason:
        if self in (CancelCause.DISCONNECT, CancelCause.BACKPRESSURE):
            return FinishReason.TRANSPORT_ERROR
        return FinishReason.CANCELLED


@dataclass(frozen=True)
class Usage:
    """What was counted, split by meaning (L6).

    - ``selected_tokens``: tokens the sampler chose, EOS and stop tokens included.
    - ``processed_prompt_tokens`` / ``processed_output_tokens``: tokens whose K/V went into the
      cache (a prefix-cache hit counts in ``cached_prompt_tokens`` instead; recomputation after
      preemption is not counted twice).
    - ``returned_tokens``: selected tokens some of whose bytes reached the stream.
    EOS and stop sequences make these differ: EOS is selected but never returned nor processed.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    selected_tokens: int = 0
    processed_prompt_tokens: int = 0
    processed_output_tokens: int = 0
    returned_tokens: int = 0
    returned_bytes: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)
