"""The early-stop policy in the engine loop: the per-token hook of :class:`~coda.output.OutputProcessor`
(SPEC D1, D2, D6, G1, L4; issue 5 item 2).

The processor calls the hook last among the per-token checks (G1), with the number of tokens
generated so far and the *confidence* of the token just chosen: its probability under the
processed distribution the sampler chose from (after penalties, grammar mask, temperature and
truncation; greedy rows use temperature 1). The hook feeds :class:`~coda.early_stop.EarlyStopController`
and returns its decision as an :class:`~coda.output.EarlyStopVerdict` — a value the core acts on;
the hook never calls into the run (issue 11 item 2):

    confidence   -> FinishReason.CONFIDENCE_STOP   (finish-reason version 2)
    max-tokens   -> FinishReason.MAX_OUTPUT_TOKENS
    deadline     -> FinishReason.DEADLINE_EXCEEDED (elapsed ms since the request's arrival, G3)
    user-cancel  -> FinishReason.CANCELLED
    continue     -> None

Every stop of the policy takes the core's cancel path (D6, seed 004: "stopping is decided here;
closing is the cancellation path"): :meth:`coda.request.RequestRun.conclude` discards the
detokenizer's pending tail and the held stop-buffer bytes, does not call ``finish()``, and ends
the request CANCELLED with the policy's own reason — never FAILED for an incomplete character.

Confidence signal (:class:`ConfidenceSignal`): one token's probability is noisy — a single
confident token inside an uncertain answer says little — so the signal is the mean probability
of the last ``window`` selected tokens (default 4; ``window=1`` is the raw per-token value).
Fewer than ``window`` tokens average what there is.

Closure (``policy.require_closure``): with a grammar, the structure is closed once the grammar
accepts (:attr:`GrammarMatcher.is_closed`); the hook then calls ``controller.mark_closed()``.
Without a grammar nothing can prove closure, so the output is never closed and a confidence
stop is impossible (deadline and budget still apply): a client asking for closure on free text
gets the conservative reading.

Reporting: every verdict carries the policy's summary (a plain dict), which the processor keeps
and the run copies into its terminal: ``reason`` (the controller's reason value), ``stopped``,
``committed_tokens``, ``saved_tokens_upper_bound``, ``confidence`` (the smoothed signal) and
``closed``. When the request ends for another reason on a later token (EOS, stop, grammar), the
summary describes the last token the policy saw and ``usage.selected_tokens`` is the billed count.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from coda.early_stop import EarlyStopController, EarlyStopDecision, EarlyStopReason
from coda.finish import FinishReason
from coda.output import EarlyStopHook, EarlyStopVerdict

__all__ = ["DEFAULT_SIGNAL", "ConfidenceSignal", "EarlyStopHook", "make_hook"]

_REASONS: dict[EarlyStopReason, FinishReason | None] = {
    EarlyStopReason.CONTINUE: None,
    EarlyStopReason.CONFIDENCE: FinishReason.CONFIDENCE_STOP,
    EarlyStopReason.MAX_TOKENS: FinishReason.MAX_OUTPUT_TOKENS,
    EarlyStopReason.DEADLINE: FinishReason.DEADLINE_EXCEEDED,
    EarlyStopReason.USER_CANCEL: FinishReason.CANCELLED,
}


class _Closable(Protocol):
    @property
    def is_closed(self) -> bool: ...


@dataclass(frozen=True)
class ConfidenceSignal:
    """The confidence fed to the policy: mean selected-token probability over the last
    ``window`` tokens (see the module docstring)."""

    window: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"ConfidenceSignal.window must be an integer >= 1, got {self.window!r}")

    def tracker(self) -> Callable[[float], float]:
        """A fresh per-request accumulator: push one probability, get the smoothed signal."""
        recent: deque[float] = deque(maxlen=self.window)

        def push(prob: float) -> float:
            # NOTE: the controller rejects non-finite or out-of-range values; a NaN prob is no
            # evidence of confidence, and float rounding may put a softmax a hair above 1.
            recent.append(min(1.0, max(0.0, prob)) if math.isfinite(prob) else 0.0)
            return sum(recent) / len(recent)

        return push


DEFAULT_SIGNAL = ConfidenceSignal()


def make_hook(controller: EarlyStopController, arrival: float, grammar: Any,
              *, signal: ConfidenceSignal = DEFAULT_SIGNAL,
              clock: Callable[[], float] = time.monotonic) -> EarlyStopHook:
    """The per-token early-stop hook for one request (see the module docstring).

    ``grammar`` is the request's :class:`~coda.engine.grammar.GrammarMatcher` or None;
    ``arrival`` is the request's arrival on ``clock`` (time.monotonic seconds)."""
    smooth = signal.tracker()
    needs_closure = controller.policy.require_closure
    closable: _Closable | None = grammar

    def hook(generated: int, confidence: float) -> EarlyStopVerdict:
        conf = smooth(confidence)
        if needs_closure and closable is not None and closable.is_closed:
            controller.mark_closed()  # NOTE: sticky in the controller: closed stays closed
        elapsed_ms = max(0, int((clock() - arrival) * 1000))
        # NOTE: count the tokens since the last call, so the controller's count is exact even
        # if some token was not shown to the hook.
        new = max(0, generated - controller.state.tokens)
        decision = controller.on_tokens(new, conf, elapsed_ms)
        return EarlyStopVerdict(_REASONS[decision.reason], _summary(controller, decision, conf))

    return hook


def _summary(controller: EarlyStopController, decision: EarlyStopDecision,
             confidence: float) -> dict[str, object]:
    # NOTE: the run copies this into its terminal event; the server reports it with usage.
    return {
        "reason": decision.reason.value,
        "stopped": decision.stop,
        "committed_tokens": decision.committed_tokens,
        "saved_tokens_upper_bound": decision.saved_tokens_upper_bound,
        "confidence": confidence,
        "closed": controller.state.closed,
    }
