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

* *Drafts* are cut before the step where they could never be accepted (``EngineCore
  ._verifiable``): at the first token the grammar forbids at its position
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
  to a sampled token (``EngineCore._live_pick``): sampled again from the loop's own row where
  its state now forces another token than the row assumed (:func:`live_forced`: a reasoning
  budget's closer at the horizon), then the closer's check, which may start forcing the
  closing path. Accepted rows before it need neither: the horizon and the closer's check at
  each position stopped the run where they would change the choice (the engine checks the
  forced token at each emitted row all the same, and ends the run at a row that disagrees).

Unconstrained requests are unchanged: all ``1 + k`` rows in the step's one batched sample.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from coda.engine.grammar import GrammarMatcher
from coda.engine.lookup import NgramIndex, copy_drafts
from coda.engine.plan import RequestPlan
from coda.engine.prediction import PredictionLookup
from coda.engine.sampler import SamplingRow, TokenDecision
from coda.engine.sequence import Sequence
from coda.engine.types import SPECULATIVE_MODES
from coda.output import OutputProcessor
from coda.reasoning import Phase

if TYPE_CHECKING:
    from coda.engine.closure import BudgetCloser
    from coda.engine.verify_costs import VerifyCosts

# NOTE: a chat prediction is the answer the client expects: its drafts start surer than a
# prompt-lookup guess (coda.engine.prediction)
PREDICTION_PRIOR = 0.8
MODES = SPECULATIVE_MODES  # NOTE: draft: coda.engine.draft
_UNBOUNDED = 1 << 30


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


class SpecState:
    """One request's drafting state: the n-gram index over its tokens, the current ``k``, the
    recent acceptance, and the counts the terminal reports (``coda.speculative``)."""

    def __init__(self, config: SpeculativeConfig, prediction: Seq[int] = ()) -> None:
        self.config = config
        # NOTE: a chat prediction's lookup (coda.engine.prediction; None: no prediction)
        self.predicted = PredictionLookup(prediction) if prediction else None
        self.counts: dict[str, int] = {"drafted": 0, "accepted": 0, "rejected": 0,
                                       "verify_steps": 0}
        self._recent: deque[tuple[int, int]] = deque(maxlen=config.window)  # (emitted, tried)
        self._index = NgramIndex(config.min_ngram, config.max_ngram, config.match_cap,
                                 config.candidates)
        self.match_length = 0  # NOTE: the last proposal's agreement (0: none; diagnostics)
        # NOTE: this step's forced rows (forced_drafts, closer_after): row j is forced to
        # forced[j] (None: not forced; the guessed drafts before a reasoning closer)
        self.forced: tuple[int | None, ...] = ()

    @property
    def acceptance(self) -> float:
        """The per-token acceptance estimate ``a``: accepted drafts over drafts decided (the
        accepted ones and the first rejected one) in the recent window, with the prior."""
        cfg = self.config
        hits = cfg.prior_accept * cfg.prior_weight + sum(h for h, _ in self._recent)
        return hits / (cfg.prior_weight + sum(t for _, t in self._recent))

    def acceptance_at(self, n: int) -> float:
        """The per-token acceptance of drafts that follow a match agreeing over ``n`` tokens:
        the request's :attr:`acceptance` ``a`` at the shortest match, surer for a longer one
        (module docstring)."""
        a = self.acceptance
        return 1.0 - (1.0 - a) * self.config.min_ngram / max(n, self.config.min_ngram)

    def k_for(self, rows: int, acceptance: float | None = None) -> int:
        """Drafts worth their rows in a step of ``rows`` sequences (module docstring), at
        ``acceptance`` (default: the request's :attr:`acceptance`); at batch 1 on an engine
        that measures its verifications, the ``k`` they price best (``config.costs``)."""
        a = self.acceptance if acceptance is None else acceptance
        costs = self.config.costs
        if rows == 1 and costs is not None and (k := costs.choose(a, self.config.k_max)) is not None:
            return k
        threshold = rows / (self.config.step_rows + rows)
        k, chance = 0, a
        while k < self.config.k_max and chance > threshold:
            k, chance = k + 1, chance * a
        return k

    def propose(self, seq: Sequence, tokens_left: int, rows: int = 1) -> tuple[int, ...]:
        """Drafts for output positions ``t + 1 ..`` of a sequence about to decode token ``t``
        (one uncomputed token) in a step of ``rows`` sequences, or () when nothing matches,
        nothing fits, or no draft is worth its row. ``tokens_left``: the processor's
        (``OutputProcessor.tokens_left``, the one home of the budget; the pick takes one)."""
        room = tokens_left - 1
        if room <= 0 or seq.num_uncomputed_tokens != 1:
            return ()
        tokens = seq.all_token_ids
        if self.predicted is not None:
            output = tokens[seq.num_prompt_tokens:]
            hit = self.predicted.match(output)
            # NOTE: the prediction first (from its start, or where the output's last 2+
            # tokens align into it: one token alone re-aligns anywhere in a file); own
            # tokens where it has no such match
            if hit is not None and (hit[1] >= 2 or not output):
                self.match_length = hit[1]
                k = min(room, self.k_for(rows, self.acceptance_at(hit[1])))
                return self.predicted.follow(hit[0], k) if k > 0 else ()
        if not self.config.lookup:
            return ()
        found = self._index.match(tokens)
        self.match_length = 0 if found is None else found[1]
        if found is None:
            return ()
        at, length = found
        k = min(room, self.k_for(rows, self.acceptance_at(length)))
        return copy_drafts(tokens, at, k) if k > 0 else ()

    def record(self, drafted: int, accepted: int, evidence: bool = True) -> None:
        """One verification's outcome: the counts and (``evidence``) the acceptance estimate,
        from the drafts that were a guess: those before this step's first forced row
        (:attr:`forced`; a forced path's drafts are never a guess)."""
        c = self.counts
        c["drafted"] += drafted
        c["accepted"] += accepted
        c["rejected"] += drafted - accepted
        c["verify_steps"] += 1
        guessed = drafted
        for j, tok in enumerate(self.forced[:drafted]):
            if tok is not None:
                guessed = j
                break
        if evidence and guessed:
            hit = min(accepted, guessed)  # NOTE: drafts after the first rejected one: undecided
            self._recent.append((hit, hit + (hit < guessed)))


def forced_path(processor: OutputProcessor, closer: BudgetCloser | None
                ) -> tuple[tuple[int, ...], bool]:
    """The tokens the per-token loop forces from the next one on, in order, as
    ``EngineCore._row`` masks them (a reasoning budget's closer first), and whether the
    request ends with the last of them: a reasoning budget's closer ids still to choose (the
    answer follows), else the budget closer's path still to choose (the request ends
    ``grammar_forced_close`` with it); ``((), False)`` when nothing is forced."""
    rest = processor.forced_tokens()
    if rest:
        return rest, False
    if closer is not None and closer.path is not None:
        return closer.path.tokens[closer.grammar.num_consumed - closer.forced_at:], True
    return (), False


def live_forced(processor: OutputProcessor, closer: BudgetCloser | None) -> int | None:
    """The token the loop's next row is forced to (None: not forced; -1: a mask that allows
    nothing, a closing path chosen to its end)."""
    forced = processor.forced_token()
    if forced is not None:
        return forced
    if closer is None or closer.path is None:
        return None
    pos = closer.grammar.num_consumed - closer.forced_at
    return closer.path.tokens[pos] if pos < len(closer.path.tokens) else -1


def forced_drafts(spec: SpecState, seq: Sequence, tokens_left: int, processor: OutputProcessor,
                  closer: BudgetCloser | None) -> tuple[int, ...]:
    """The drafts of a request whose next tokens are forced (module docstring, "A forced path
    is its own draft"): the forced path, without its last token where that ends the request
    (the last row picks it), at most ``k_max`` and never past the budget; () when nothing is
    forced. Sets ``spec.forced`` (the rows :func:`row_mask` forces) for this step."""
    path, ends = forced_path(processor, closer)
    spec.forced = path
    if not path or seq.num_uncomputed_tokens != 1:
        return ()
    k = min(spec.config.k_max, tokens_left - 1, len(path) - ends)
    return path[:max(k, 0)]


def closer_after(spec: SpecState, drafts: tuple[int, ...], horizon: int,
                 processor: OutputProcessor, room: int) -> tuple[int, ...]:
    """``drafts`` (guesses, already cut to :func:`plain_horizon`), followed by the reasoning
    budget's closer ids where they reach it (module docstring, "A forced path is its own
    draft"): row ``horizon`` is the one where the closer is forced, so with every guess
    accepted the closer's ids are chosen in this same step, with plain decoding's one-token
    masks (:attr:`SpecState.forced`, set here). At most ``k_max`` of them and ``room`` drafts
    in all (the budget); ``drafts`` unchanged where they stop short of the horizon or no
    reasoning block with a budget is open. A guess that ends the block early (or is not
    counted) leaves the loop's state different from the rows' assumption at the first forced
    row: the engine checks it at every emitted row (:func:`live_forced`) and draws that row
    again from its own state, so the output never depends on this."""
    sp = processor.splitter
    if (not drafts or len(drafts) != horizon or sp is None or not sp.in_reasoning
            or sp.spec.budget_tokens is None):
        return drafts
    ids = sp.spec.close_ids[:max(0, min(spec.config.k_max, room - len(drafts)))]
    if not ids:
        return drafts
    spec.forced = (None,) * len(drafts) + ids
    return drafts + ids


def row_mask(forced: Seq[int | None], j: int, vocab_size: int) -> torch.Tensor | None:
    """Row ``j``'s mask where a forced path decides it (plain decoding's one-token mask), else
    None (the grammar's, or none)."""
    tok = forced[j] if j < len(forced) else None
    if tok is None:
        return None
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[tok] = True
    return mask


def plain_horizon(processor: OutputProcessor, closer: BudgetCloser | None) -> int:
    """How many drafts a request can verify now: rows ``1 .. h - 1`` are then sure to be
    chosen with the grammar's own mask (or none), as :func:`row_at` samples them, and row
    ``h`` is checked again when it is the pick (``EngineCore._live_pick``). 0 while the
    budget closer forces its path or a reasoning budget forces its closer; inside (or
    before) a reasoning block with a budget, the tokens left of it: the closer is forced at
    the first row where the block holds ``budget_tokens`` tokens, and each row adds at most
    one (guesses that reach it are followed by the closer's ids: :func:`closer_after`)."""
    if (closer is not None and closer.forcing) or processor.forced_token() is not None:
        return 0
    sp = processor.splitter
    if sp is None or sp.phase is Phase.ANSWER or sp.spec.budget_tokens is None:
        return _UNBOUNDED
    return max(0, sp.spec.budget_tokens - processor.reasoning_tokens)


def row_at(base: SamplingRow, drafts: Seq[int], j: int,
           mask: torch.Tensor | None = None) -> SamplingRow:
    """Row ``j`` of a verification: what plain decoding samples at output position
    ``base.step + j`` once ``drafts[:j]`` were chosen (row 0 is ``base`` itself); ``mask``:
    the grammar's allowed tokens after ``drafts[:j]`` (None: unconstrained)."""
    if j == 0:
        return base
    return replace(base, step=base.step + j, allowed_token_ids_mask=mask,
                   output_token_ids=list(base.output_token_ids) + list(drafts[:j]))


def verify_rows(base: SamplingRow, drafts: Seq[int], forced: Seq[int | None] = (),
                vocab_size: int = 0) -> list[SamplingRow]:
    """Rows ``0..k`` of an unconstrained request's verification (:func:`row_at`); ``forced``:
    the forced path's rows (:func:`row_mask`; row 0's is ``base``'s own)."""
    return [row_at(base, drafts, j, row_mask(forced, j, vocab_size))
            for j in range(len(drafts) + 1)]


def verify_constrained(base: SamplingRow, first: TokenDecision, drafts: Seq[int],
                       grammar: GrammarMatcher,
                       sample: Callable[[int, SamplingRow], TokenDecision],
                       admits: Callable[[int, int], bool] | None = None,
                       forced: Seq[int | None] = (), vocab_size: int = 0,
                       ) -> tuple[list[TokenDecision], int]:
    """Sample-and-match under a grammar (module docstring, "Constrained requests").

    ``first`` is row 0's decision (``base``: the grammar's mask now). Draft ``d_j`` is
    accepted iff it equals row ``j``'s pick and ``admits(d_j, j)`` (the budget closer's check
    as plain decoding makes it there; None: no closer); only then is the grammar advanced
    past it and row ``j + 1`` sampled, ``sample(j + 1, row)``, with the mask after
    ``d_0 .. d_j`` (a forced row: plain decoding's one-token mask, :func:`row_mask`, the
    grammar advanced all the same). The grammar is rolled back after. Returns the decisions of rows
    ``0 .. a`` and ``a``, the accepted count: decision ``a`` is the pick after them."""
    decs = [first]
    with grammar.lookahead() as ahead:
        for j, d in enumerate(drafts):
            if decs[j].token_id != d or (admits is not None and not admits(d, j)) or \
                    not ahead.push(d):
                return decs, j
            mask = row_mask(forced, j + 1, vocab_size)
            decs.append(sample(j + 1, row_at(base, drafts, j + 1,
                                             ahead.mask() if mask is None else mask)))
    return decs, len(drafts)


def accepted_prefix(drafts: Seq[int], decisions: Seq[TokenDecision]) -> int:
    """How many drafted tokens equal the pick of their row (the sample-and-match rule)."""
    a = 0
    while a < len(drafts) and decisions[a].token_id == drafts[a]:
        a += 1
    return a


class DraftCosts:
    """Issue 21 item 2: what a draft model's drafts cost, measured on the engine's clock, and
    the ``k`` that maximizes expected tokens per second (coda.engine.draft prices each request).

    Two running estimates, each cheap (a few multiply-adds per forward):

    * the target's decode step, ``seconds = N * plain + x * row`` for ``N`` sequences and ``x``
      drafted rows: exponentially decayed least squares over the decode-only forwards, with a
      weak prior ``row = plain / (1 + step_rows)`` (the row cost docs/speculative.md measures)
      that only decides what the data leave open (no drafted row seen yet, or always the same
      ``k``);
    * the draft's forward per position and sequence (``draft``): an exponential average over
      the one-token draft forwards (a prefill or a catch-up is not a position's cost).

    With ``a`` the request's per-token acceptance, ``k`` drafts emit ``E(k) = 1 + a + .. + a^k``
    tokens for ``N * plain + k * (row + draft)`` seconds of the step; plain decoding emits
    ``N`` for ``N * plain``. :meth:`choose` returns the ``k`` with the most tokens per second,
    0 when no ``k`` beats plain decoding (a draft as dear as its target never drafts).
    """

    def __init__(self, step_rows: float = SpeculativeConfig.step_rows, decay: float = 0.9,
                 prior_weight: float = 1e-4) -> None:
        self.decay = decay
        self.ratio = 1.0 / (1.0 + step_rows)  # NOTE: prior row / plain
        self.prior_weight = prior_weight
        self._sums = [0.0] * 5  # NOTE: decayed N*N, N*x, x*x, N*y, x*y
        self.draft: float | None = None
        self.forwards = 0       # target forwards observed
        self.draft_forwards = 0

    def observe_step(self, seqs: int, extra_rows: int, seconds: float) -> None:
        """A target decode step of ``seqs`` sequences with ``extra_rows`` drafted rows."""
        d, s = self.decay, self._sums
        for i, v in enumerate((seqs * seqs, seqs * extra_rows, extra_rows * extra_rows,
                               seqs * seconds, extra_rows * seconds)):
            s[i] = d * s[i] + v
        self.forwards += 1

    def observe_draft(self, seqs: int, seconds: float) -> None:
        """A draft forward choosing one position for each of ``seqs`` sequences."""
        each = seconds / seqs
        self.draft = each if self.draft is None else (
            self.decay * self.draft + (1 - self.decay) * each)
        self.draft_forwards += 1

    def step(self) -> tuple[float, float] | None:
        """(plain, row): a sequence's plain step and a drafted row, in seconds (None: no
        target step observed yet)."""
        nn, nx, xx, ny, xy = self._sums
        if nn <= 0:
            return None
        w, q = self.prior_weight, self.ratio
        # NOTE: minimizes sum (y - N p - x r)^2 + w (r - q p)^2: with nn > 0 never singular
        a, b, c = nn + w * q * q, nx - w * q, xx + w
        det = a * c - b * b
        plain, row = (c * ny - b * xy) / det, (a * xy - b * ny) / det
        return max(plain, 1e-9), max(row, 0.0)

    def choose(self, acceptance: float, k_max: int, seqs: int = 1) -> int | None:
        """The best ``k <= k_max`` for a request with per-token ``acceptance`` in a step of
        ``seqs`` speculating sequences; None while nothing is measured yet."""
        step = self.step()
        if step is None or self.draft is None or min(self.forwards, self.draft_forwards) < 2:
            return None  # NOTE: one forward may be a first call's allocations: measure more
        plain, row = step
        per_draft = row + self.draft
        best_k, best = 0, 1.0 / plain  # NOTE: seqs tokens for seqs * plain seconds
        tokens, chance = float(seqs), 1.0
        for k in range(1, k_max + 1):
            chance *= acceptance
            tokens += chance
            rate = tokens / (seqs * plain + k * per_draft)
            if rate > best:
                best_k, best = k, rate
        return best_k
