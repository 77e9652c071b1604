"""The termination rules of one request and the hooks that end it early (SPEC S1, L4, K3, G1,
D2, D6; issues 13, 20, 23): what :class:`coda.output.OutputProcessor` is told once, at its
construction, and never asks again.

:class:`OutputSpec` is the normalised rule set: the token budget and the reason reaching it
ends with (L4), EOS ids, stop strings and stop token-id sequences (S1), the K3 tail policy at
the drain, where stop strings stop applying (a tool call's tag, issue 13), the stops' floor
(issue 20 D6) and the reasoning split (issue 23). The engine's plan extends it. The hooks are
the per-token questions the processor asks after the emit (G1): the grammar's (done? which
reason at the budget?) and the early-stop policy's verdict (D2, D6), a decision it returns,
never a call back up. Plain data: no function here runs per token.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coda.finish import FinishReason
from coda.reasoning import ReasoningSpec

# A grammar hook answers "must the output end now?" after the token was consumed: True
# (grammar_complete) or the exact reason (grammar_forced_close, coda.engine.closure).
GrammarDone = Callable[[], "bool | FinishReason"]
# At max tokens / context limit: a grammar closed within the budget names its own reason.
GrammarBudgetEnd = Callable[[], "FinishReason | None"]


@dataclass(frozen=True)
class EarlyStopVerdict:
    """What the early-stop policy decided after one token (D2, D6): ``reason`` None to
    continue, else the stop's own reason, which the driver takes down the *cancel* path
    (:meth:`coda.request.RequestRun.conclude`); ``summary`` is the policy's state (committed
    tokens, saved bound, confidence) for the terminal. A decision, never a call back up."""

    reason: FinishReason | None
    summary: Mapping[str, object]


# An early-stop hook maps (token count, confidence) to its verdict.
EarlyStopHook = Callable[[int, float], EarlyStopVerdict]


@dataclass(frozen=True)
class OutputSpec:
    """Termination rules of one request, normalised once (S1). ``max_tokens``: the most tokens
    the request selects (the token budget, its one name; resolved by coda.engine.plan, never
    past the context); ``budget_end``: the reason reaching it ends with, ``max_output_tokens``,
    or ``context_limit`` where the plan found no budget before the context (L4). The plan
    decides both, so the per-token checks compare the count with one number, once (G1: the
    max-tokens check, then the context's, which a plan's budget always reaches first).

    The engine's plan (:class:`coda.engine.plan.RequestPlan`) extends this class: the core
    declares the part of the plan it reads, the engine hands it the plan itself (one frozen
    object per request); the reference loop and the processor's tests build one directly."""

    max_tokens: int
    budget_end: FinishReason = FinishReason.MAX_OUTPUT_TOKENS
    eos_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[tuple[int, ...], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # K3 at the drain (UTF8_TAIL_POLICIES): "auto" (a budget end cuts a partial last character
    # off, recorded; any other end with one is FAILED), "fail" (the strict rule: FAILED,
    # decoding_error) or "drop" (any incomplete tail is removed, recorded, FINISHED)
    utf8_tail: str = "auto"
    # Stop strings are matched only up to the end of the first occurrence of this text (a tool
    # call's opening tag, issue 13); from there the grammar alone ends the output, so a stop
    # string never cuts a constrained call. Empty: stop strings apply everywhere.
    stops_end_at: bytes = b""
    # Stops (strings and id sequences) end the output only at a token t >= min_tokens; see
    # docs/api.md (issue 20 D6). EOS is banned by the sampler until then.
    min_tokens: int = 0
    # Issue 23: split ``<think>…</think>`` off the answer (coda.reasoning); None: no split.
    # Stops and their holdback apply to the answer only.
    reasoning: ReasoningSpec | None = None


UTF8_TAIL_POLICIES: tuple[str, ...] = ("auto", "fail", "drop")
"""K3 policies for a tail that is not whole characters when the output ends (docs/api.md)."""

# Ends where something other than the model cut the output (K3): a partial last character is
# text the budget did not finish. Cancel takes the discard path and never drains.
BUDGET_ENDS = frozenset({FinishReason.MAX_OUTPUT_TOKENS, FinishReason.CONTEXT_LIMIT,
                         FinishReason.DEADLINE_EXCEEDED})

