"""The reasoning markers a model declares and the spec a request gets from them (issue 23;
SPEC K2, S1, L6): ``marker_ids`` accepts both markers only as decodable, non-special tokens;
``reasoning_spec`` decides "inside" from the prompt's ids against a brute-force oracle, and a
budget the model cannot honour is a 400 naming the caller's field."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel

from coda.errors import InvalidRequestError
from coda.reasoning import CLOSE_MARKER, OPEN_MARKER, marker_ids, reasoning_spec
from tests.conftest import examples

OPEN, CLOSE = 7, 9  # NOTE: not 0/1, so an index or a count mistaken for an id shows


def _tokenizer(*, open_special: bool = False, close_special: bool = False,
               has_open: bool = True, has_close: bool = True) -> Tokenizer:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "f": 6, "g": 8}
    if has_open:
        vocab[OPEN_MARKER] = OPEN
    if has_close:
        vocab[CLOSE_MARKER] = CLOSE
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    added = []
    if has_open:
        added.append((OPEN_MARKER, open_special))
    if has_close:
        added.append((CLOSE_MARKER, close_special))
    for text, special in added:
        tok.add_tokens([AddedToken(text, special=special, normalized=False)])
    return tok


def test_k2_both_plain_markers_give_their_ids_in_order() -> None:
    assert marker_ids(_tokenizer()) == (OPEN, CLOSE)


@pytest.mark.parametrize("kwargs", [{"has_open": False}, {"has_close": False},
                                    {"open_special": True}, {"close_special": True}],
                         ids=["no-opener", "no-closer", "special-opener", "special-closer"])
def test_k2_a_missing_or_special_marker_means_no_split(kwargs: dict[str, bool]) -> None:
    """A special marker would be skipped by the detokenizer, so the split could not see it."""
    assert marker_ids(_tokenizer(**kwargs)) is None


def _oracle_inside(ids: list[int]) -> bool:
    last = {t: max((i for i, x in enumerate(ids) if x == t), default=-1) for t in (OPEN, CLOSE)}
    return last[OPEN] > last[CLOSE]


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.sampled_from([1, 2, OPEN, CLOSE]), max_size=12),
       st.one_of(st.none(), st.integers(1, 64)))
def test_k2_inside_is_the_last_opener_after_the_last_closer(ids: list[int],
                                                            budget: int | None) -> None:
    spec = reasoning_spec(_tokenizer(), ids, budget=budget, budget_field="thinking")
    assert spec is not None
    assert spec.inside is _oracle_inside(ids)
    assert (spec.open_ids, spec.close_ids, spec.budget_tokens) == ((OPEN,), (CLOSE,), budget)


def test_l6_no_markers_no_budget_is_no_split_and_a_budget_is_a_400_naming_the_field() -> None:
    tok = _tokenizer(has_close=False)
    assert reasoning_spec(tok, [1, OPEN], budget=None, budget_field="x") is None
    with pytest.raises(InvalidRequestError) as err:
        reasoning_spec(tok, [1], budget=5, budget_field="thinking.budget_tokens")
    assert err.value.field == "thinking.budget_tokens"
    assert "no reasoning markers" in str(err.value) and OPEN_MARKER in str(err.value)
