"""Prompt lookup's matcher (issue 21): where in a request's own tokens to copy drafts from.

A request's tokens ``T = prompt + output`` end in a suffix that may have occurred before. The
**match** is the earlier occurrence whose agreement with the end of ``T``, read backwards, is
the longest: an end position ``at < len(T)`` (the token ``T[at]`` followed it) maximizing
``L(at)``, the largest ``L <= cap`` with ``T[at - L:at] == T[len(T) - L:]``, over the
occurrences of the suffix ``max_ngram``-gram (else the ``max_ngram - 1``-gram, .. down to
``min_ngram``), ties to the most recent. Only the ``candidates`` most recent occurrences of
the gram are compared (a common 2-gram, a newline and an indent, occurs hundreds of times).

Why the longest and not the most recent: in a copy the most recent occurrence of a short gram
is often elsewhere in the text (``= None,`` after any argument), while the occurrence that
agrees over 20 tokens is the line being copied; and the agreement is what prices the drafts
(:meth:`coda.engine.speculative_state.SpecState.acceptance_at`): on the benchmark's copy outputs a
match of 20+ tokens is followed by a run of accepted drafts, one of 2 tokens by about one.

**Drafts** are the tokens after the match, ``T[at], T[at + 1], ..``, continued through the
drafts themselves once they pass the end of ``T`` (an LZ77 copy with overlap): a line that
repeats every ``p`` tokens drafts past its last ``p`` tokens.

:func:`longest_match` is the brute-force rule (the tests' oracle); :class:`NgramIndex` gives
the same answer from an index of positions grown as tokens are appended.
"""

from __future__ import annotations

from collections.abc import Sequence


def agreement(tokens: Sequence[int], at: int, cap: int) -> int:
    """``L(at)``: how many tokens before ``at`` equal the end of ``tokens``, at most ``cap``."""
    n_tok, length = len(tokens), 0
    while length < cap and length < at and tokens[at - 1 - length] == tokens[n_tok - 1 - length]:
        length += 1
    return length


def copy_drafts(tokens: Sequence[int], at: int, k: int) -> tuple[int, ...]:
    """``k`` tokens from ``at`` on, continued through the drafts past the end (module
    docstring)."""
    out = list(tokens[at:at + k])
    n_tok = len(tokens)
    while len(out) < k:  # NOTE: at + j >= n_tok: the token drafted j - (n_tok - at) before
        out.append(out[len(out) - (n_tok - at)])
    return tuple(out)


def longest_match(tokens: Sequence[int], min_ngram: int, max_ngram: int, cap: int,
                  candidates: int) -> tuple[int, int] | None:
    """The brute-force rule (module docstring): ``(at, L(at))`` or None when no occurrence
    of the suffix ``min_ngram``-gram ends before the last token."""
    n_tok = len(tokens)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n_tok <= n:
            continue
        ends = [at for at in range(n, n_tok) if list(tokens[at - n:at]) == list(tokens[n_tok - n:])]
        best: tuple[int, int] | None = None
        for at in reversed(ends[-candidates:]):
            length = agreement(tokens, at, max(cap, max_ngram))
            if best is None or length > best[1]:
                best = (at, length)
        if best is not None:
            return best
    return None


class NgramIndex:
    """Per ``n`` in ``min_ngram..max_ngram``: gram -> the end positions of its occurrences
    (oldest first), extended as the tokens grow (a request's are only ever appended to;
    shorter tokens than last time rebuild it)."""

    def __init__(self, min_ngram: int, max_ngram: int, cap: int, candidates: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.cap, self.candidates = max(cap, max_ngram), candidates
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)}
        self._indexed = 0

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """:func:`longest_match` of ``tokens`` (which extend the ones seen before)."""
        n_tok = len(tokens)
        if n_tok < self._indexed:  # NOTE: not a request's tokens (they only grow): start over
            self._ends = {n: {} for n in self._ends}
            self._indexed = 0
        for end in range(max(self._indexed, 1), n_tok):  # NOTE: end < n_tok: a follower exists
            for n, grams in self._ends.items():
                if end >= n:
                    grams.setdefault(tuple(tokens[end - n:end]), []).append(end)
        self._indexed = n_tok
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            ends = self._ends[n].get(tuple(tokens[n_tok - n:])) if n_tok > n else None
            if not ends:
                continue
            best: tuple[int, int] | None = None
            for at in reversed(ends[-self.candidates:]):
                length = agreement(tokens, at, self.cap)
                if best is None or length > best[1]:
                    best = (at, length)
                    if length >= self.cap:
                        break  # NOTE: no later candidate can beat the cap; the most recent wins
            return best
        return None
