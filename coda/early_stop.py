"""Early termination of streamed output: policy, per-delta decision, economics (SPEC D1–D4, D6).

Seed 004 §4.2 (``src/perf/output-stream.ts``) ported to Python with the same validation,
precedence, rounding and finality.

Contract (D6): this module only *decides* whether to stop, why, and how many tokens are owed.
It never closes anything. Acting on a stopping decision — ending the request and closing the
connection — goes through the ordinary cancellation path of the lifecycle rules (SPEC L/C), so
an early stop releases resources and emits its single terminal event exactly like a cancel.

Pure Python: no torch, no I/O. Every invalid input raises
:class:`coda.errors.InvalidRequestError` whose ``field`` names the culprit (D1,
:mod:`coda.early_stop_checks`). The stream-failure decision (D5), which the engine asks when a
model error ends a request, is :mod:`coda.early_stop_failure`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from coda.early_stop_checks import fail, require_bool, require_confidence, require_int

__all__ = [
    "EarlyStopController",
    "EarlyStopDecision",
    "EarlyStopPolicy",
    "EarlyStopReason",
    "EarlyStopState",
    "StopEconomics",
    "approximate_output_tokens",
    "evaluate_stop_economics",
]


# --------------------------------------------------------------------------- D3
def approximate_output_tokens(text: str) -> int:
    """D3: a code point above U+007F counts 1 token, an ASCII one 1/4; the sum is rounded up.

    Counted in integer quarters so no float drift can move the ceiling.
    """
    quarters = sum(4 if ord(ch) > 0x7F else 1 for ch in text)
    return (quarters + 3) // 4  # NOTE: ceil(quarters / 4) in integers


# --------------------------------------------------------------------------- D1
@dataclass(frozen=True, slots=True)
class EarlyStopPolicy:
    """D1: when a stream may be stopped early. Validated on construction.

    ``max_tokens`` is the hard output budget; ``require_closure`` means structured output may
    stop on confidence only after :meth:`EarlyStopController.mark_closed`.
    """

    min_tokens: int
    max_tokens: int
    deadline_ms: int
    confidence_threshold: float
    no_retry_after_first_frame: bool
    require_closure: bool = False

    def __post_init__(self) -> None:
        require_int(self.min_tokens, "min_tokens", 0)
        require_int(self.max_tokens, "max_tokens", 1)
        require_int(self.deadline_ms, "deadline_ms", 1)
        require_confidence(self.confidence_threshold, "confidence_threshold")
        require_bool(self.no_retry_after_first_frame, "no_retry_after_first_frame")
        require_bool(self.require_closure, "require_closure")
        if self.min_tokens > self.max_tokens:
            raise fail("min_tokens must not exceed max_tokens", "min_tokens")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EarlyStopPolicy:
        """Build from a JSON object with snake_case or the reference's camelCase keys.

        Unknown keys, a key given in both spellings, and missing required keys are rejected;
        ``field`` always uses the snake_case name.
        """
        if not isinstance(data, Mapping):
            raise fail("policy must be an object", "early_stop")
        values: dict[str, Any] = {}
        for key, value in data.items():
            name = _POLICY_KEYS.get(key) if isinstance(key, str) else None
            if name is None:
                raise fail(f"unknown policy key {key!r}", str(key))
            if name in values:
                raise fail(f"{name} given twice (snake_case and camelCase)", name)
            values[name] = value
        for name in _REQUIRED_KEYS:
            if name not in values:
                raise fail(f"{name} is required", name)
        return cls(**values)


_SNAKE_TO_CAMEL: dict[str, str] = {
    "min_tokens": "minTokens",
    "max_tokens": "maxTokens",
    "deadline_ms": "deadlineMs",
    "confidence_threshold": "confidenceThreshold",
    "no_retry_after_first_frame": "noRetryAfterFirstFrame",
    "require_closure": "requireClosure",
}
_POLICY_KEYS: dict[str, str] = {
    **{snake: snake for snake in _SNAKE_TO_CAMEL},
    **{camel: snake for snake, camel in _SNAKE_TO_CAMEL.items()},
}
_REQUIRED_KEYS: tuple[str, ...] = tuple(k for k in _SNAKE_TO_CAMEL if k != "require_closure")


def sent_keys(data: object) -> dict[str, str]:
    """Each policy field (its snake_case name, an error's ``field``) → the key ``data`` spelled
    it with (snake_case or camelCase), for errors in the client's own words; a field not sent
    keeps its name."""
    out = dict(zip(_SNAKE_TO_CAMEL, _SNAKE_TO_CAMEL, strict=True))
    for key in data if isinstance(data, Mapping) else ():
        if isinstance(key, str) and key in _POLICY_KEYS:
            out[_POLICY_KEYS[key]] = key
    return out


# --------------------------------------------------------------------------- D2
class EarlyStopReason(StrEnum):
    """D2: why a delta did (or did not) stop the stream."""

    CONTINUE = "continue"
    CONFIDENCE = "confidence"
    MAX_TOKENS = "max-tokens"
    DEADLINE = "deadline"
    USER_CANCEL = "user-cancel"


@dataclass(frozen=True, slots=True)
class EarlyStopDecision:
    """D2: ``committed_tokens`` are generated and billed; ``saved_tokens_upper_bound`` is
    ``max(0, max_tokens - committed_tokens)``, the most a stop here can save."""

    stop: bool
    reason: EarlyStopReason
    committed_tokens: int
    saved_tokens_upper_bound: int


@dataclass(frozen=True, slots=True)
class EarlyStopState:
    """A snapshot of the controller; taking it changes nothing."""

    tokens: int
    confidence: float
    first_frame_at_ms: int | None
    elapsed_ms: int
    closed: bool
    cancelled: bool
    cancel_reason: str | None
    stopped: bool


class EarlyStopController:
    """D2: one per streamed request. Decides *whether* to stop; never closes anything (D6).

    Precedence on each delta: cancel, deadline, max tokens, then confidence (only once
    ``min_tokens`` are out and, if the policy requires it, the structure is closed). The first
    stopping decision is final: every later call returns that same object.
    """

    def __init__(
        self, policy: EarlyStopPolicy, count_tokens: Callable[[str], int] | None = None
    ) -> None:
        if not isinstance(policy, EarlyStopPolicy):
            raise fail("policy must be an EarlyStopPolicy", "policy")
        self._policy = policy
        self._count = count_tokens if count_tokens is not None else approximate_output_tokens
        self._tokens = 0
        self._confidence = 0.0
        self._first_frame_at_ms: int | None = None
        self._elapsed_ms = 0
        self._closed = False
        self._cancelled = False
        self._cancel_reason: str | None = None
        self._decision: EarlyStopDecision | None = None  # NOTE: set once, only when stopping

    @property
    def policy(self) -> EarlyStopPolicy:
        return self._policy

    @property
    def decision(self) -> EarlyStopDecision | None:
        """The final stopping decision, or None while the stream may continue."""
        return self._decision

    @property
    def state(self) -> EarlyStopState:
        return EarlyStopState(
            tokens=self._tokens,
            confidence=self._confidence,
            first_frame_at_ms=self._first_frame_at_ms,
            elapsed_ms=self._elapsed_ms,
            closed=self._closed,
            cancelled=self._cancelled,
            cancel_reason=self._cancel_reason,
            stopped=self._decision is not None,
        )

    def mark_closed(self) -> None:
        """The structured output is closed: a confidence stop is now allowed (D1)."""
        self._closed = True

    def cancel(self, reason: str = "user") -> EarlyStopDecision:
        """Record a cancel; returns ``user-cancel`` unless a stop was already decided."""
        if not isinstance(reason, str):
            raise fail("reason must be a string", "reason")
        self._cancelled = True
        self._cancel_reason = reason
        return self._finalize(EarlyStopReason.USER_CANCEL)

    def on_delta(self, text: str, confidence: float, elapsed_ms: int) -> EarlyStopDecision:
        """A text delta; its tokens are counted with ``count_tokens`` (default D3)."""
        if self._decision is not None:
            return self._decision
        if not isinstance(text, str):
            raise fail("text must be a string", "text")
        conf = require_confidence(confidence, "confidence")
        elapsed = require_int(elapsed_ms, "elapsed_ms", 0)
        n_tokens = self._count(text) if text != "" else 0
        if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 0:
            raise ValueError(f"count_tokens returned {n_tokens!r}, not an integer >= 0")
        return self._advance(n_tokens, text != "", conf, elapsed)

    def on_tokens(
        self, n_tokens: int, confidence: float, elapsed_ms: int, text: str = ""
    ) -> EarlyStopDecision:
        """Like :meth:`on_delta` for an engine that knows the exact token count.

        ``text`` is the delta's decoded text, possibly empty (a token may end mid-character);
        the delta counts as output when it carries tokens or text.
        """
        if self._decision is not None:
            return self._decision
        if not isinstance(text, str):
            raise fail("text must be a string", "text")
        conf = require_confidence(confidence, "confidence")
        elapsed = require_int(elapsed_ms, "elapsed_ms", 0)
        count = require_int(n_tokens, "n_tokens", 0)
        return self._advance(count, count > 0 or text != "", conf, elapsed)

    def _advance(
        self, n_tokens: int, has_output: bool, confidence: float, elapsed_ms: int
    ) -> EarlyStopDecision:
        policy = self._policy
        self._elapsed_ms = elapsed_ms
        if has_output:
            # NOTE: an empty delta is a heartbeat: it moves the clock but not the confidence.
            self._tokens += n_tokens
            self._confidence = confidence
            if self._first_frame_at_ms is None:
                self._first_frame_at_ms = elapsed_ms
        # NOTE: no cancel check here: cancel() decides at once, so a cancelled controller
        # never reaches this point (every later call returns that decision)
        if self._elapsed_ms >= policy.deadline_ms:
            return self._finalize(EarlyStopReason.DEADLINE)
        if self._tokens >= policy.max_tokens:
            return self._finalize(EarlyStopReason.MAX_TOKENS)
        confident = (
            self._tokens >= policy.min_tokens and self._confidence >= policy.confidence_threshold
        )
        closure_ready = not policy.require_closure or self._closed
        if confident and closure_ready:
            return self._finalize(EarlyStopReason.CONFIDENCE)
        return EarlyStopDecision(
            stop=False,
            reason=EarlyStopReason.CONTINUE,
            committed_tokens=self._tokens,
            saved_tokens_upper_bound=max(0, policy.max_tokens - self._tokens),
        )

    def _finalize(self, reason: EarlyStopReason) -> EarlyStopDecision:
        if self._decision is None:
            self._decision = EarlyStopDecision(
                stop=True,
                reason=reason,
                committed_tokens=self._tokens,
                saved_tokens_upper_bound=max(0, self._policy.max_tokens - self._tokens),
            )
        return self._decision


# --------------------------------------------------------------------------- D4
def _js_round(value: float) -> int:
    """JavaScript ``Math.round``: nearest integer, ties toward +inf (Python rounds to even)."""
    floor = math.floor(value)
    # NOTE: value - floor is exact for a double, so the tie test has no rounding error.
    return floor + 1 if value - floor >= 0.5 else floor


@dataclass(frozen=True, slots=True)
class StopEconomics:
    """D4: what stopping now saves against what a wrong stop (a re-ask) is expected to cost."""

    saved_tokens: int
    saved_micros: int
    wrong_probability: float
    expected_loss_micros: int
    net_micros: int
    break_even_confidence: float
    worth_stopping: bool


def evaluate_stop_economics(
    emitted_tokens: int,
    expected_full_tokens: int,
    confidence: float,
    micros_per_token: int,
    reask_cost_micros: int,
) -> StopEconomics:
    """D4: saved = max(0, full - emitted); loss = ceil((1 - confidence) * reask);
    break-even confidence = clamp(1 - saved_micros / reask) rounded to 6 places."""
    emitted = require_int(emitted_tokens, "emitted_tokens", 0)
    full = require_int(expected_full_tokens, "expected_full_tokens", 0)
    micros = require_int(micros_per_token, "micros_per_token", 0)
    reask = require_int(reask_cost_micros, "reask_cost_micros", 0)
    conf = require_confidence(confidence, "confidence")
    saved_tokens = max(0, full - emitted)
    saved_micros = saved_tokens * micros
    wrong = 1.0 - conf
    # NOTE: the -1e-9 keeps (1 - 0.7) * 1000 = 300.00000000000006 from billing 301 (reference).
    expected_loss = math.ceil(wrong * reask - 1e-9)
    raw = 0.0 if reask == 0 else min(1.0, max(0.0, 1.0 - saved_micros / reask))
    net = saved_micros - expected_loss
    return StopEconomics(
        saved_tokens=saved_tokens,
        saved_micros=saved_micros,
        wrong_probability=wrong,
        expected_loss_micros=expected_loss,
        net_micros=net,
        break_even_confidence=_js_round(raw * 1_000_000) / 1_000_000,
        worth_stopping=net > 0,
    )
