"""The chat prediction's alignment (SPEC O1, T4; coda.engine.prediction): the usage count
(``accepted_prediction_tokens``: the prediction's tokens the output has, in order) against a
brute-force longest-common-subsequence table, and the draft matcher against the rule written
out over every position of the prediction."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.prediction import PredictionLookup, aligned_count, prediction_counts

_TOKENS = st.lists(st.integers(0, 5), max_size=40)


def _lcs_oracle(a: Sequence[int], b: Sequence[int]) -> int:
    """The quadratic table: the longest common subsequence's length."""
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            table[i][j] = (table[i - 1][j - 1] + 1 if a[i - 1] == b[j - 1]
                           else max(table[i - 1][j], table[i][j - 1]))
    return table[len(a)][len(b)]


@settings(max_examples=400, deadline=None)
@given(_TOKENS, _TOKENS)
def test_o1_aligned_count_is_the_longest_common_subsequence(pred: list[int], out: list[int]
                                                            ) -> None:
    """O1: the bit-parallel count equals the table's, and rejected is the rest."""
    assert aligned_count(pred, out) == _lcs_oracle(pred, out)
    counts = prediction_counts(pred, out)
    assert counts["accepted"] + counts["rejected"] == len(pred)
    assert counts["rejected"] >= 0


def test_o1_aligned_count_examples() -> None:
    """O1: an exact copy accepts all; an edit in the middle keeps both sides in order; a
    reordered prediction accepts only one order; tokens past the prediction are not counted."""
    assert aligned_count([1, 2, 3], [1, 2, 3]) == 3
    assert aligned_count([1, 2, 3, 4, 5], [1, 2, 9, 9, 4, 5]) == 4
    assert aligned_count([1, 2, 3], [3, 2, 1]) == 1
    assert aligned_count([1, 2], [1, 2, 1, 2, 1, 2]) == 2
    assert aligned_count([], [1]) == 0 and aligned_count([1], []) == 0
    long = list(range(300)) * 3  # NOTE: wider than a machine word
    assert aligned_count(long, long[::2]) == len(long[::2])


def _match_oracle(pred: Sequence[int], out: Sequence[int], point: int, max_ngram: int,
                  cap: int) -> tuple[int, int] | None:
    """The rule (coda.engine.prediction), over every position: the longest suffix gram of the
    output (``max_ngram`` down to 1) occurring in the prediction with a follower; among its
    occurrences the longest agreement, ties to the first at or after ``point``, else the
    first."""
    if not out:
        return (0, 0) if pred else None
    for n in range(min(max_ngram, len(out)), 0, -1):
        ends = [at for at in range(n, len(pred)) if list(pred[at - n:at]) == list(out[-n:])]
        if not ends:
            continue

        def agreement(at: int) -> int:
            length = 0
            while (length < cap and length < at and length < len(out)
                   and pred[at - 1 - length] == out[-1 - length]):
                length += 1
            return length

        best = max(agreement(at) for at in ends)
        tied = [at for at in ends if agreement(at) == best]
        after = [at for at in tied if at >= point]
        return (after[0] if after else tied[0], best)
    return None


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=30), st.lists(st.integers(0, 4), max_size=30),
       st.integers(0, 30))
def test_t4_prediction_match_is_the_rule(pred: list[int], out: list[int], point: int) -> None:
    """T4 (drafts only ever cost rows): the indexed matcher gives the rule's position and
    agreement (few enough occurrences that its candidate limit compares them all)."""
    look = PredictionLookup(pred, max_ngram=4, cap=64, candidates=64)
    look.point = point
    assert look.match(out) == _match_oracle(pred, out, point, 4, 64)


def test_t4_an_edit_that_rejoins_drafts_again_from_where_it_rejoined() -> None:
    """T4: the output starts at the prediction's start, leaves it (an edit), and re-joins:
    the drafts continue from the re-joined position, forward of the last point."""
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 11, 12, 13]
    look = PredictionLookup(pred)
    assert look.match([]) == (0, 0)
    assert look.follow(0, 3) == (10, 11, 12)
    out = [10, 11, 12, 99, 98]  # NOTE: an edit: 13 replaced by two tokens
    assert look.match(out) is None
    out += [14, 15]  # NOTE: re-joins
    at, length = look.match(out)  # type: ignore[misc]
    assert (at, length) == (6, 2)
    assert look.follow(at, 4) == (16, 17, 18, 19)
    # NOTE: a gram occurring twice: the occurrence at or after the point wins a tie
    look.point = 8
    assert look.match([11, 12]) == (12, 2)
    look.point = 0
    assert look.match([11, 12]) == (3, 2)
    assert look.follow(len(pred), 4) == ()  # NOTE: never past the prediction's end


def test_t4_a_fresh_lookup_prefers_the_first_occurrence_and_follow_moves_the_point() -> None:
    """T4: before any draft the point is the prediction's start (a match of a repeated gram
    takes its first occurrence); ``follow`` moves the point, so the next tie goes forward."""
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 11, 12, 13]
    look = PredictionLookup(pred)
    assert look.match([11, 12]) == (3, 2)
    assert look.follow(12, 1) == (13,)
    assert look.point == 12
    assert look.match([11, 12]) == (12, 2)


def test_t4_agreement_stops_at_the_cap() -> None:
    """T4: the agreement read backwards is at most ``cap`` tokens (never below the gram)."""
    pred = list(range(20))
    look = PredictionLookup(pred, max_ngram=4, cap=4)
    assert look.match(list(range(12))) == (12, 4)
    assert PredictionLookup(pred, max_ngram=4, cap=2).cap == 4
    assert PredictionLookup(pred, max_ngram=2, cap=6).match(list(range(12))) == (12, 6)


def test_o1_prediction_counts_survive_the_durable_log() -> None:
    """O1, P3: the terminal's prediction counts round-trip through the stream log's codecs
    (JSON and MessagePack), so a replay reports the usage the first delivery did."""
    from coda.durable.codec import decode_event, encode_event, pack_run, unpack_events
    from coda.finish import FinishReason, Terminal, Usage
    from coda.lifecycle import State
    from coda.stream import EventType, StreamEvent

    for counts in ({"accepted": 7, "rejected": 3}, None):
        term = Terminal(State.FINISHED, FinishReason.EOS, Usage(prompt_tokens=2),
                        prediction=counts)
        ev = StreamEvent("r", 3, EventType.TERMINAL, terminal=term)
        assert decode_event(encode_event(ev)).terminal == term
        blob, _ = pack_run([ev])
        assert unpack_events("r", blob)[-1].terminal == term
