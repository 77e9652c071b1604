"""One request's drafting state (issue 21; SPEC T1, T4, O1): where its drafts come from and how
many are worth their rows (coda.engine.speculative's module docstring: "Drafting", "How many").

Prompt lookup over the request's own tokens (:mod:`coda.engine.lookup`) or a chat prediction
(:mod:`coda.engine.prediction`) proposes the tokens; the request's recent acceptance, priced
by the match's agreement, decides ``k``; the counts are what the terminal reports.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from coda.engine.lookup import NgramIndex, copy_drafts
from coda.engine.prediction import PredictionLookup
from coda.engine.sequence import Sequence

if TYPE_CHECKING:
    from coda.engine.speculative import SpeculativeConfig


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

