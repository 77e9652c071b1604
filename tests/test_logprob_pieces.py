"""Exact per-token bytes for logprobs (SPEC P1, K4; issue 11 item 4): a token's ``piece`` is
the bytes it adds to the text it continues, also for SentencePiece/Metaspace tokenizers whose
lone-token decode drops the leading space."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda import detokenizer
from coda.detokenizer import profile_of
from tests.conftest import examples
from tests.tokenizer_fixtures import ALL_FAMILIES, CORPUS

# NOTE: WordPiece lowercases and re-spaces punctuation on decode, so its concatenation is a
# different (normalised) text; its pieces are still the in-context difference.
EXACT_FAMILIES = ["byte_level_bpe", "sentencepiece_bpe", "metaspace_bpe"]
WORDS = sorted({w for line in CORPUS for w in line.split()})


@pytest.fixture(autouse=True)
def _fresh_profiles() -> None:
    """Each test builds its profile (its pieces and anchor) itself: one cached for the session
    would hide a defect in computing a piece (the mutation harness forks after the cache fills)."""
    detokenizer._PROFILES.clear()


@pytest.mark.parametrize("family", ["sentencepiece_bpe", "metaspace_bpe"])
def test_p1_k4_sentencepiece_piece_keeps_the_leading_space(family: str) -> None:
    """K4: a ``▁word`` token in the middle of a text is `` word``; its one-token decode,
    which logprobs used before, is ``word``."""
    tok = ALL_FAMILIES[family]()
    words = sorted(t for t in tok.get_vocab() if t.startswith("▁") and t[1:].isalpha())
    assert words
    for token in words:
        i = tok.token_to_id(token)
        assert tok.decode([i]) == token[1:]  # NOTE: the bug: a lone decode drops the space
        assert profile_of(tok).piece(i) == b" " + token[1:].encode()


@pytest.mark.parametrize("family", EXACT_FAMILIES)
def test_p1_k4_pieces_concatenate_to_the_decoded_continuation(family: str) -> None:
    """For all texts: the pieces of ``ids`` (encoded words) concatenate to exactly the bytes
    ``decode(prefix + ids)`` adds after ``decode(prefix)`` (the brute-force oracle)."""
    tok = ALL_FAMILIES[family]()
    prefix = tok.encode("Hello there").ids

    @settings(deadline=None, max_examples=examples(80))
    @given(st.lists(st.sampled_from(WORDS), min_size=1, max_size=12))
    def check(words: list[str]) -> None:
        ids = tok.encode(" ".join(words), add_special_tokens=False).ids
        head = tok.decode(prefix).encode()
        full = tok.decode(prefix + ids).encode()
        assert full.startswith(head)
        assert b"".join(profile_of(tok).piece(i) for i in ids) == full[len(head):]

    check()
