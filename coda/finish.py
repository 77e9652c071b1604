"""How a request ended: finish reasons, usage and the terminal record (SPEC L4, L5, L6, P1, P5).

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

:class:`Terminal` is what the stream's single terminal event carries (P1): the request's state
and reason, its :class:`Usage` (L6) and its phase times (P5, :class:`PhaseTimes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, TypedDict

from coda.errors import ErrorCode
from coda.lifecycle import State
from coda.stops import STOP_RULE_VERSION

if TYPE_CHECKING:
    from coda.reasoning import ReasoningSplit
    from coda.stops import StopHit
    from coda.stream import TokenInfo

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
    - ``returned_tokens``: selected tokens at least one of whose bytes is in the returned
      text: every token of a character split over several (the detokenizer releases it whole,
      with the last); none of a token with no bytes, of the tokens wholly in a stop string or
      past it, or of a partial character a budget end cut (K3). A removed reasoning marker's
      bytes count as reached (issue 23).
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


class PhaseTimes(TypedDict):
    """A terminal's P5 phase times as one group (:meth:`Terminal.timings`): the wire's
    ``coda.timings`` object and the durable log's record; a type only, the values live on the
    terminal."""

    queue_s: float
    prefill_s: float
    decode_s: float
    stop_buffer_s: float
    first_token_s: float | None
    total_s: float


@dataclass(frozen=True)
class Terminal:
    """What the single terminal event says (P1, L4, L6, P5): the one record of how a request
    ended — its state and reason, what it counted (``usage``) and how long each phase took
    (P5, the ``*_s`` fields; network send is measured by the transport)."""

    state: State
    finish_reason: FinishReason
    usage: Usage
    error_code: ErrorCode | None = None
    error_message: str | None = None
    stop: StopHit | None = None
    # P5: seconds in each phase (issue 22: on the terminal itself, no object of their own)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_buffer_s: float = 0.0
    first_token_s: float | None = None  # arrival -> first selected token
    total_s: float = 0.0
    # Tokens selected after the last delta whose bytes never reached a delta (held, EOS, stop).
    trailing_tokens: tuple[TokenInfo, ...] = ()
    # seed 004 (D2): the early-stop decision — committed tokens and the saved upper bound
    early_stop: Mapping[str, object] | None = None
    # K2: an incomplete UTF-8 tail removed under utf8_tail="drop" (empty: nothing removed)
    dropped_tail: bytes = b""
    # L4, S4: the versions of the finish-reason enum and of the stop tie rule in force
    finish_reason_version: int = FINISH_REASON_VERSION
    stop_rule_version: str = STOP_RULE_VERSION
    # P1: the start event's content identity of the model that produced the output
    model_snapshot: str | None = None
    # Issue 23, K2: the reasoning split (removed markers, reasoning byte count, forced close);
    # None when the output had no reasoning block (coda.reasoning)
    reasoning: ReasoningSplit | None = None
    # issue 21, O1: drafted / accepted / rejected tokens and verification steps of a request
    # that speculated (None: it did not); usage counts accepted tokens only
    speculative: Mapping[str, int] | None = None
    # O1, echo: each prompt token after the first, scored in the prefill (a request with
    # ``prompt_logprobs``; empty otherwise): its record as if decoded (coda.engine.core)
    prompt_logprobs: tuple[TokenInfo, ...] = ()
    # S3, K2: the first ``trailing_shown`` trailing tokens are text (cut to it, like the last
    # delta's at a stop): a token whose first bytes a delta sent before a stop string that
    # starts inside it. Reported even when the end is a stop or EOS (coda.server.logprobs).
    trailing_shown: int = 0
    # O1: a chat prediction's ``accepted`` / ``rejected`` tokens against the output's
    # (coda.engine.prediction; None: no prediction), the same with or without drafting
    prediction: Mapping[str, int] | None = None

    def timings(self) -> PhaseTimes:
        """The P5 phase times as one group (``coda.timings`` on the wire, the durable log)."""
        return PhaseTimes(queue_s=self.queue_s, prefill_s=self.prefill_s,
                          decode_s=self.decode_s, stop_buffer_s=self.stop_buffer_s,
                          first_token_s=self.first_token_s, total_s=self.total_s)
