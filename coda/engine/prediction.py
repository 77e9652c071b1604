"""OpenAI's predicted outputs (chat ``prediction``) as a draft source and as usage counts.

**Counts** (what OpenAI bills; SPEC O1): ``accepted`` is how many of the prediction's tokens
appear in the output's tokens in order — the length of their longest common subsequence —
and ``rejected`` the rest of the prediction. They depend on the two token lists alone, so they
are the same whether or not the prediction drafted (:func:`aligned_count`, Hyyrö's
bit-parallel LCS: one pass over the output with integer operations on a bitmask as wide as the
prediction; the tests compare it with the quadratic table).

**Drafting** (issue 21's exact verification, docs/speculative.md "Predicted outputs"): the
drafts are the prediction's tokens from the point the output has reached in it
(:class:`PredictionLookup`). Before any output token the point is the prediction's start;
after, the output's last tokens are aligned into the prediction n-gram style: among the
occurrences in the prediction of the output's last ``max_ngram`` tokens (else fewer, down to
one), the one that agrees with the output's end over the most tokens (read backwards, at most
``cap``), ties to the first at or after the last point (the output moves forward through the
prediction), else to the first. The engine drafts from a match only where it agrees over at
least 2 tokens (or at the start): one token alone re-aligns anywhere in a file, and its drafts
were mostly rejected. So an edit that leaves the prediction and re-joins it drafts again from
the second token after it re-joined. Drafts never pass the prediction's end. A wrong draft costs a
verified row, never a different output: every draft passes the same sample-and-match rule as
prompt lookup's.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence


def aligned_count(prediction: Sequence[int], output: Sequence[int]) -> int:
    """How many tokens of ``prediction`` appear in ``output`` in order (their longest common
    subsequence's length), by bit-parallel LCS over the prediction's positions."""
    n = len(prediction)
    if n == 0 or not output:
        return 0
    where: dict[int, int] = {}
    for i, tok in enumerate(prediction):
        where[tok] = where.get(tok, 0) | (1 << i)
    mask = (1 << n) - 1
    row = mask  # NOTE: a 0 bit at i: prediction[i] closes one more common token
    for tok in output:
        hits = where.get(tok)
        if hits is None:
            continue
        u = row & hits
        row = ((row + u) | (row - u)) & mask
    return n - bin(row).count("1")


def prediction_counts(prediction: Sequence[int], output: Sequence[int]) -> Mapping[str, int]:
    """The usage's ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``."""
    accepted = aligned_count(prediction, output)
    return {"accepted": accepted, "rejected": len(prediction) - accepted}


class PredictionLookup:
    """Where in the prediction the output has got to, and the drafts from there (module
    docstring). ``candidates``: occurrences compared per gram, on each side of the last
    point (a newline and an indent occur hundreds of times in a file)."""

    def __init__(self, prediction: Sequence[int], max_ngram: int = 4, cap: int = 64,
                 candidates: int = 16) -> None:
        self.prediction = tuple(prediction)
        self.max_ngram, self.cap, self.candidates = max_ngram, max(cap, max_ngram), candidates
        self.point = 0  # NOTE: the last match's position (the next prediction token)
        # NOTE: per n: gram -> the positions ``at`` (ascending) with prediction[at-n:at] ==
        # gram and a follower prediction[at]
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {}
        p = self.prediction
        for n in range(1, max_ngram + 1):
            grams: dict[tuple[int, ...], list[int]] = {}
            for at in range(n, len(p)):
                grams.setdefault(p[at - n:at], []).append(at)
            self._ends[n] = grams

    def _agreement(self, output: Sequence[int], at: int) -> int:
        p, n_out, length = self.prediction, len(output), 0
        while (length < self.cap and length < at and length < n_out
               and p[at - 1 - length] == output[n_out - 1 - length]):
            length += 1
        return length

    def match(self, output: Sequence[int]) -> tuple[int, int] | None:
        """``(at, agreement)``: the prediction position the output continues at, or None
        where the output's end occurs nowhere in it (or nothing of it is left)."""
        if not output:
            return (0, 0) if self.prediction else None
        for n in range(min(self.max_ngram, len(output)), 0, -1):
            ends = self._ends[n].get(tuple(output[len(output) - n:]))
            if not ends:
                continue
            i = bisect_left(ends, self.point)
            # NOTE: the nearest occurrences at or after the point first, then before it
            order = ends[i:i + self.candidates] + ends[max(0, i - self.candidates):i]
            best: tuple[int, int] | None = None
            for at in order:
                length = self._agreement(output, at)
                if best is None or length > best[1]:
                    best = (at, length)
            return best
        return None

    def follow(self, at: int, k: int) -> tuple[int, ...]:
        """The drafts from a match at ``at``: up to ``k`` prediction tokens (never past its
        end); ``at`` becomes the point later matches prefer."""
        self.point = at
        return self.prediction[at:at + k]
