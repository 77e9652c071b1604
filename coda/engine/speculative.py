"""Exact prompt-lookup (n-gram) speculative decoding (issue 21; SPEC T1, T4, G1, L6, L7, O1).

**Drafting.** A request drafts from its own prompt and output: the longest suffix n-gram
(``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier in ``prompt + output``
proposes the tokens that followed the occurrence that agrees longest with the end of the
tokens (up to ``match_cap`` back; ties to the most recent: :mod:`coda.engine.lookup`), at most
``k`` of them, and never past the request's budget (the last verified row picks output token
``max_tokens - 1`` at the latest), so never past the context either.

**How many (cost-aware k).** A drafted row is not free: on the CPU kernels a step of ``1 + k``
rows costs about ``(F + 1 + k) / (F + 1)`` times a one-row step, where ``F`` (``step_rows``) is
the step's fixed cost in rows' worth (measured: docs/speculative.md). The ``j``-th draft is
worth its row when the chance that it is emitted, ``a**j`` (``a``: the request's per-token
acceptance over its recent verifications, from a prior of ``prior_accept``), exceeds the
tokens-per-row rate of the step without it, ``N / (F + N)`` for ``N`` sequences in the step.
So ``k`` is the largest ``j <= k_max`` with ``a**j > N / (F + N)``: long runs at batch 1 when
the request copies, fewer drafts in a crowd (where a row costs everyone's latency), and none
once acceptance stays low (the request then decodes plainly to its end, but where a longer
match says it copies again). At batch 1 an engine that times its verifications
(``SpeculativeConfig.costs``, :mod:`coda.engine.verify_costs`: the serving engine does) gives
instead the ``k`` with the most expected tokens per measured second: a row's cost is neither
one constant across machines nor a line (the kernels' row tiles make it a staircase). A longer match is surer: drafts after a suffix match of ``n``
tokens (the match's agreement, up to ``match_cap``) are priced with ``a_n = 1 - (1 - a) *
min_ngram / n`` (:meth:`SpecState.acceptance_at`; on the benchmark's greedy copy outputs the
chance that the copy goes on one more token after an agreement of 2 / 4 / 5-6 / 7-10 / 11-20
tokens was 0.62 / 0.83 / 0.87 / 0.94 / 1.0, which this line follows and ``sqrt(min_ngram / n)``
priced at 0.62 / 0.73 / 0.78 / 0.83 / 0.88; docs/speculative.md "Where drafting loses").

**Verification** is the same engine step: the drafted tokens ride after the sequence's pending
token as extra query rows of its chunk (:class:`~coda.engine.scheduler.ScheduledChunk`
``num_draft``), and every row's logits come back. The model's rows are batch invariant (T4: the
load refuses speculation in a mode that is not), so row ``j`` has exactly the logits plain
decoding would compute after the accepted prefix.

**Acceptance (sample-and-match).** Row ``j`` is sampled as plain decoding samples output
position ``t + j``: the processed logits use the prefix ``output + drafts[:j]`` (penalties,
min_tokens) and the request's counter RNG at step ``t + j`` (:func:`verify_rows`). The drafted
token is accepted iff it equals that pick; the first mismatch emits the pick and drops the
rest; when all ``k`` match, row ``k``'s pick is a bonus token. Not ``min(1, p/q)`` rejection
sampling: that keeps the distribution, not the seeded output.

**Emission** (the core): every emitted token goes through the exact loop one by one
(``EngineCore._on_decision``), so a stop string, stop id, EOS, max_tokens or context limit in
an accepted run ends the request where plain decoding ends it; cancel, deadline and a paused
reader are checked before each token after the first. Before each accepted draft is followed,
its K/V (written by this step's forward) is committed (``Scheduler.commit_draft``) with the
same ``decode.started``/``decode.completed`` rows and processed count plain decoding writes
(L6, O1). The rejected tail is rolled back (``Scheduler.rollback``: its blocks freed, never
registered in the prefix cache), so nothing of it reaches the stream, the usage or the cache.

**Constrained requests** (a grammar: ``response_format``, tools; the budget closer; a reasoning
budget) speculate too, by the same rule: each row's processed logits are plain decoding's
after the accepted prefix, the grammar included.

* *Drafts* are cut before the step where they could never be accepted (``core_spec
  .verifiable``): at the first token the grammar forbids at its position
  (:meth:`~coda.engine.grammar.GrammarMatcher.valid_prefix`: its row's pick is constrained,
  so never that token), and at :func:`plain_horizon`: inside a reasoning block with a budget
  no more than the tokens the budget has left (the row where the closer is forced is the last).
* *A forced path is its own draft* (:func:`forced_drafts`): while the budget closer forces its
  closing path or a reasoning budget forces its closer, the tokens plain decoding will choose
  are known in advance (:func:`forced_path`), so they are drafted instead of prompt lookup's
  (or the draft model's) guess, and each of their rows is sampled with the one-token mask
  plain decoding's row has there (:func:`row_mask`): the pick is the forced token, with plain
  decoding's logprobs, so every such draft is accepted. The budget closer's path ends the
  request with its last token, which is the pick of the last row (never a draft); after a
  reasoning closer the bonus row is the answer's first token, under the grammar's mask.
  Guesses that reach a reasoning budget's limit (:func:`plain_horizon`: the next row is the
  one where the closer is forced) are followed by the closer's ids in the same step
  (:func:`closer_after`; :attr:`SpecState.forced` is then ``None`` for the guessed rows), so
  the closer never waits for a step of its own. Only the guesses are evidence of the
  request's acceptance (:meth:`SpecState.record`).
* *Verification* (:func:`verify_constrained`): row 0 is sampled with the step's batch; row
  ``j + 1`` only once ``d_j`` is accepted, with the mask of the grammar advanced through
  ``d_0 .. d_j`` (a forced row's one-token mask instead) (:class:`~coda.engine.grammar.Lookahead`, rolled back after: the request's
  grammar only ever consumes emitted tokens, in ``_on_decision``). So a mask is computed only
  for a row plain decoding also needs (none for a rejected row; the rows are sampled one at a
  time instead of in one batch). With a budget closer, ``d_j`` is accepted only where the
  closer admits it at that position (:meth:`~coda.engine.closure.BudgetCloser.admits` with
  ``ahead = j``), as plain decoding's check would.
* *The pick* (the first mismatch, or the bonus row) goes through what the per-token loop does
  to a sampled token (``core_spec.live_pick``): sampled again from the loop's own row where
  its state now forces another token than the row assumed (:func:`live_forced`: a reasoning
  budget's closer at the horizon), then the closer's check, which may start forcing the
  closing path. Accepted rows before it need neither: the horizon and the closer's check at
  each position stopped the run where they would change the choice (the engine checks the
  forced token at each emitted row all the same, and ends the run at a row that disagrees).
* *A grammar waits for the answer* (issue 23): inside a reasoning block the request holds its
  grammar aside (``EngineRequest.held``) and its rows are verified unconstrained; the emitted
  token that closes the block restores it, and the row after it (sampled without its mask) is
  the pick, drawn again from the loop's own row (``core_spec.emit_verified``'s ``stale``).

Unconstrained requests are unchanged: all ``1 + k`` rows in the step's one batched sample.

**Where it lives.** This module: the knobs (:class:`SpeculativeConfig`), the load's refusal
(:func:`refusal`) and which requests speculate (:func:`state_for`). The per-request drafting
state (prompt lookup, a prediction, ``k``, the acceptance): :mod:`coda.engine.speculative_state`.
Which drafts a step verifies and how its rows are sampled and accepted (forced paths, the
horizon, sample-and-match): :mod:`coda.engine.speculative_verify`. A draft model's measured
costs: :mod:`coda.engine.speculative_costs`. The engine's side of a speculating step (its
drafts in, the verified tokens out): :mod:`coda.engine.core_spec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from coda.engine.plan import RequestPlan
from coda.engine.speculative_state import SpecState
from coda.engine.types import SPECULATIVE_MODES

if TYPE_CHECKING:
    from coda.engine.verify_costs import VerifyCosts

# NOTE: a chat prediction is the answer the client expects: its drafts start surer than a
# prompt-lookup guess (coda.engine.prediction)
PREDICTION_PRIOR = 0.8
MODES = SPECULATIVE_MODES  # NOTE: draft: coda.engine.draft


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup knobs (the row cost measured in docs/speculative.md)."""

    min_ngram: int = 2
    max_ngram: int = 4
    k_max: int = 8
    step_rows: float = 1.2     # F: a step's fixed cost, in rows' worth (module docstring)
    prior_accept: float = 0.65  # a request's per-token acceptance before any verification
    prior_weight: int = 4      # ... worth this many verified tokens
    window: int = 8            # verifications the acceptance is estimated over
    # NOTE: coda.engine.lookup: a match's agreement is read back this far (it prices the
    # drafts: acceptance_at), over this many of the gram's most recent occurrences
    match_cap: int = 64
    candidates: int = 16
    # NOTE: the engine's measured verifications (coda.engine.verify_costs): at batch 1 they
    # price k instead of step_rows; None (tests, a draft model): the row rule alone
    costs: VerifyCosts | None = field(default=None, compare=False, repr=False)
    # NOTE: draft from the request's own tokens (False: only a chat prediction's drafts,
    # coda.engine.prediction: a server without --speculative prompt-lookup)
    lookup: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram or self.k_max < 1:
            raise ValueError("SpeculativeConfig: need 1 <= min_ngram <= max_ngram, k_max >= 1")
        if self.step_rows < 0 or not 0 < self.prior_accept < 1 or self.window < 1 or \
                self.candidates < 1:
            raise ValueError("SpeculativeConfig: need step_rows >= 0, 0 < prior_accept < 1, "
                             "window >= 1, candidates >= 1")


def refusal(mode: str, batch_invariant: bool, mode_name: str) -> str | None:
    """Why ``--speculative mode`` cannot run on this load (None: it can)."""
    if mode not in MODES:
        return f"unknown --speculative {mode!r}; modes: {', '.join(MODES)}"
    if mode != "off" and not batch_invariant:
        return (f"--speculative {mode} needs a batch-invariant serving mode (T4): verifying "
                f"drafted tokens as extra rows gives plain decoding's logits only where a "
                f"row's bits do not depend on its batch; --quant {mode_name} is NOT "
                f"batch-invariant (use --quant auto)")
    return None


def state_for(config: SpeculativeConfig | None, plan: RequestPlan,
              predicted: SpeculativeConfig | None = None) -> SpecState | None:
    """The request's speculation state, or None where it does not speculate (off on the
    server, ``speculative: false`` on the request). A grammar, the budget closer and a
    reasoning budget speculate too (the module docstring's "Constrained requests"). A
    request with a chat prediction drafts from it under ``predicted`` (the engine's config
    for predictions: None where its mode cannot verify exactly), whatever the server flag."""
    if not plan.speculative:
        return None
    if plan.prediction and predicted is not None:
        return SpecState(predicted, prediction=plan.prediction)
    if config is None:
        return None
    return SpecState(config)

