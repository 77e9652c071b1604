"""Prompt lookup's matcher (issue 21; ``coda/engine/lookup.py``; SPEC T4: what is drafted never
changes the output, so these check only which drafts are proposed and how they are priced).

:class:`NgramIndex` against :func:`longest_match` (the rule written out) and both against a
plainer brute force (every earlier position's agreement, the longest, ties to the most recent),
on random token lists grown in random strides as a request grows; :func:`copy_drafts` against
its defining property (the drafts continue ``tokens + drafts`` from the match); and
``SpecState`` drafting from the longest agreement, pricing by it, and copying a repeated line
past its end.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.lookup import NgramIndex, agreement, copy_drafts, longest_match
from coda.engine.sequence import Sequence as Seq
from coda.engine.speculative import SpeculativeConfig
from coda.engine.speculative_state import SpecState
from tests.conftest import examples


def _plain_best(tokens: Sequence[int], min_ngram: int, cap: int) -> tuple[int, int] | None:
    """Every position ``at`` (the token after an earlier occurrence) with its agreement, the
    longest wins, ties to the most recent: what the matcher returns when every occurrence of
    the gram is a candidate."""
    best: tuple[int, int] | None = None
    for at in range(1, len(tokens)):
        length = agreement(tokens, at, cap)
        if length >= min_ngram and (best is None or length >= best[1]):
            best = (at, length)
    return best


_TOKENS = st.lists(st.integers(0, 3), min_size=0, max_size=60)


@settings(max_examples=examples(300), deadline=None)
@given(tokens=_TOKENS, min_ngram=st.integers(1, 3), extra=st.integers(0, 3),
       cap=st.integers(1, 12))
def test_t4_rule_is_the_longest_agreement_ties_to_the_most_recent(
        tokens: list[int], min_ngram: int, extra: int, cap: int) -> None:
    """With every occurrence a candidate, the rule (the longest suffix gram, then the longest
    agreement among its occurrences) is the plain brute force over all positions."""
    max_ngram = min_ngram + extra
    got = longest_match(tokens, min_ngram, max_ngram, cap, candidates=1000)
    assert got == _plain_best(tokens, min_ngram, max(cap, max_ngram))


@settings(max_examples=examples(300), deadline=None)
@given(tokens=_TOKENS, strides=st.lists(st.integers(1, 5), min_size=1, max_size=30),
       min_ngram=st.integers(1, 3), extra=st.integers(0, 3), cap=st.integers(1, 12),
       candidates=st.integers(1, 4))
def test_t4_index_grown_in_strides_matches_the_rule(
        tokens: list[int], strides: list[int], min_ngram: int, extra: int, cap: int,
        candidates: int) -> None:
    """The index, fed the request's tokens as they grow (one token a step, or several when
    drafts are accepted), answers as the rule would on each prefix, the candidate limit
    included."""
    max_ngram = min_ngram + extra
    index = NgramIndex(min_ngram, max_ngram, cap, candidates)
    end = 0
    for stride in strides:
        end = min(len(tokens), end + stride)
        prefix = tokens[:end]
        assert index.match(prefix) == longest_match(prefix, min_ngram, max_ngram, cap,
                                                    candidates), prefix


@settings(max_examples=examples(300), deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=2, max_size=30), data=st.data())
def test_t4_copy_drafts_continue_the_tokens_and_the_drafts_from_the_match(
        tokens: list[int], data: st.DataObject) -> None:
    at = data.draw(st.integers(1, len(tokens) - 1))
    k = data.draw(st.integers(0, 20))
    drafts = copy_drafts(tokens, at, k)
    ext = tokens + list(drafts)
    assert len(drafts) == k
    assert all(ext[at + j] == drafts[j] for j in range(k))


def test_copy_drafts_repeat_a_period_past_the_end() -> None:
    # NOTE: "1 2" repeats: the match right before the end drafts the period over and over
    assert copy_drafts([5, 1, 2, 1, 2], 3, 5) == (1, 2, 1, 2, 1)
    assert copy_drafts([7, 7, 7], 2, 4) == (7, 7, 7, 7)


def _decoding_seq(tokens: list[int], outputs: list[int]) -> Seq:
    seq = Seq(1, tokens, max_total_tokens=1000)
    seq.output_token_ids = list(outputs)
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


def test_drafts_follow_the_longest_agreement_not_the_most_recent_gram() -> None:
    """The copied line (``4 1 2 3`` then ``7 8 9``) agrees over 4 tokens; a later ``2 3``
    (followed by ``5``) only over 2: the drafts copy the line, priced by its agreement."""
    state = SpecState(SpeculativeConfig(min_ngram=2, max_ngram=3, k_max=3, prior_accept=0.99))
    seq = _decoding_seq([4, 1, 2, 3, 7, 8, 9, 0, 2, 3, 5, 6], [4, 1, 2, 3])
    assert state.propose(seq, tokens_left=100) == (7, 8, 9)
    assert state.match_length == 4


def test_a_longer_agreement_drafts_more_at_the_same_acceptance() -> None:
    """a_n = 1 - (1 - a) * min_ngram / n (the line the copy outputs follow): at a = 0.6 and
    F = 1.2 (batch 1: the j-th draft is worth its row while a_n**j > 1 / 2.2 = 0.45), a
    2-token agreement drafts 1 (0.6**2 = 0.36), a 10-token one k_max 8 (0.92**8 = 0.51)."""
    cfg = SpeculativeConfig(k_max=8, step_rows=1.2, prior_accept=0.6, prior_weight=4)
    state = SpecState(cfg)
    assert state.acceptance_at(2) == pytest.approx(0.6)
    assert state.acceptance_at(4) == pytest.approx(0.8)
    assert state.acceptance_at(10) == pytest.approx(0.92)
    # NOTE: "5 6" agrees over 2 tokens (9 5 6 / 0 5 6)
    assert state.propose(_decoding_seq([9, 5, 6, 1, 2, 3], [0, 5, 6]), 100) == (1,)
    assert state.match_length == 2
    line = list(range(10, 30))
    state = SpecState(cfg)
    assert state.propose(_decoding_seq(line + [1] + line[:9], [line[9]]), 100) == \
        tuple(line[10:18])
    assert state.match_length == 10


def test_a_repeated_line_is_drafted_past_its_last_copy() -> None:
    """A degenerate output that repeats one 5-token line: the match is the previous copy,
    its agreement the whole repeated run, and the drafts go on past the end of the tokens."""
    line = [11, 12, 13, 14, 15]
    state = SpecState(SpeculativeConfig(k_max=8, step_rows=1.2, prior_accept=0.9))
    seq = _decoding_seq([1, 2] + line * 3, [line[0]])
    drafts = state.propose(seq, tokens_left=100)
    assert drafts == tuple((line * 3)[1:9])
    # NOTE: the latest copy agrees back to the first copy's start (11 tokens), the one before
    # over 6
    assert state.match_length == 11


def test_only_the_most_recent_candidates_are_compared() -> None:
    """"1 2" ends at 3, 7 and 11; the oldest agrees over 3 tokens (7 1 2), the others over 2:
    with 3 candidates it wins, with 2 it is never compared and the most recent one does."""
    tokens = [7, 1, 2, 5, 0, 1, 2, 6, 3, 1, 2, 8, 7, 1, 2]
    for candidates, want in ((3, (3, 3)), (2, (11, 2)), (1, (11, 2))):
        assert longest_match(tokens, 2, 2, 64, candidates) == want
        assert NgramIndex(2, 2, 64, candidates).match(tokens) == want


@settings(max_examples=examples(300), deadline=None)
@given(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=40), data=st.data())
def test_agreement_is_the_longest_suffix_equal_before_at_up_to_the_cap(
        tokens: list[int], data: st.DataObject) -> None:
    """``agreement`` (which the oracles above share) against its definition: the largest
    ``L <= min(cap, at)`` with ``T[at - L:at] == T[len(T) - L:]``."""
    at = data.draw(st.integers(0, len(tokens) - 1))
    cap = data.draw(st.integers(0, 50))
    n = len(tokens)
    want = max(L for L in range(min(cap, at) + 1) if tokens[at - L:at] == tokens[n - L:])
    assert agreement(tokens, at, cap) == want


def test_agreement_stops_at_the_cap_and_at_the_start_of_the_tokens() -> None:
    """"1 2" agrees over all 2 tokens before ``at = 2``: the start of the tokens ends it (no
    wrap to the end), and a cap of 1 ends it earlier."""
    assert agreement([1, 2, 1, 2], 2, 10) == 2
    assert agreement([1, 2, 1, 2], 2, 1) == 1
    assert agreement([3, 3, 3, 3, 3], 3, 2) == 2


def test_grams_at_the_very_start_are_indexed() -> None:
    """A gram that ends at position ``n`` (it starts at 0) is an occurrence, and a 1-gram
    ending at 1 too."""
    assert NgramIndex(2, 2, 64, 8).match([1, 2, 3, 1, 2]) == longest_match(
        [1, 2, 3, 1, 2], 2, 2, 64, 8) == (2, 2)
    assert NgramIndex(1, 1, 64, 8).match([5, 5]) == (1, 1)


def test_the_index_grown_call_by_call_keeps_each_position_once() -> None:
    """Called after every appended token (as a request grows), the index holds each end once:
    with 2 candidates the 2 most recent occurrences are compared, never one of them twice."""
    tokens = [9, 1, 2, 4, 1, 2, 5, 1, 2, 6, 9, 1, 2]
    index = NgramIndex(2, 2, 64, 2)
    for n in range(1, len(tokens) + 1):
        assert index.match(tokens[:n]) == longest_match(tokens[:n], 2, 2, 64, 2), n


def test_shorter_tokens_than_last_time_rebuild_the_index() -> None:
    """Tokens that do not extend the last ones (another request's) are matched afresh: no end
    position of the old tokens survives."""
    index = NgramIndex(2, 2, 64, 8)
    assert index.match([4, 4, 7, 7, 4, 4, 7, 7, 4, 4]) == (6, 6)
    assert index.match([7, 7, 1, 7, 7]) == longest_match([7, 7, 1, 7, 7], 2, 2, 64, 8) == (2, 2)
