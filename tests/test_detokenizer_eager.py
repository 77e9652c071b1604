"""The incremental detokenizer emits every character as soon as it is final (SPEC K1, K2, K3;
issue 8). The K2 oracles compare concatenations, so a detokenizer that held one character
longer than needed would pass them; this property compares what ``push`` returned so far,
after every push, with the longest prefix of the oracle output that no further token can
change:

- byte-level BPE: the text of the bytes so far that every continuation keeps (brute force:
  continuations that complete any partial character, and one that completes none), so an
  incomplete but still valid UTF-8 sequence at the end is the only thing held;
- byte-fallback families (``<0xNN>`` tokens): ``decode`` of the ids up to the last text token
  (a text token closes a byte run; a run is decoded as one unit, so none of it is final yet),
  or of all of them when the open run is already invalid UTF-8 (it renders one U+FFFD per
  byte whatever follows).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from coda.detokenizer import IncrementalDetokenizer
from tests.conftest import examples
from tests.test_detokenizer import _byte_ids, _ids_strategy
from tests.tokenizer_fixtures import ALL_FAMILIES, SPECIAL_TOKENS

# Continuations that complete every valid partial UTF-8 character (the second byte's range
# starts at 0x80, 0x90 or 0xA0 depending on the lead byte) and one that completes none.
_ENDINGS = (b"A", b"\x80" * 3, b"\x90" * 3, b"\xa0" * 3, b"\xbf" * 3)


def _final_byte_level(tok: Tokenizer, ids: list[int]) -> bytes:
    """Byte-level: the longest prefix that every continuation keeps (brute force over
    continuations that complete any partial character and one that breaks it)."""
    by_char = {chr(c): b for b, c in _char_of_byte(tok).items()}
    specials = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    raw = b"".join(bytes(by_char[c] for c in tok.id_to_token(i) or "")
                   for i in ids if i not in specials)
    texts = [(raw + end).decode("utf-8", "replace") for end in _ENDINGS]
    return os.path.commonprefix(texts).encode()


def _char_of_byte(tok: Tokenizer) -> dict[int, int]:
    """Byte value -> code point of its GPT-2 alphabet character (via the byte tokens)."""
    return {b: ord(tok.id_to_token(i) or "") for b, i in enumerate(_byte_ids(tok))}


def _final_byte_fallback(tok: Tokenizer, ids: list[int]) -> bytes:
    """Byte fallback: decode of the ids up to and including the last text token."""
    specials = {tok.token_to_id(t) for t in SPECIAL_TOKENS}
    byte_tokens = set(_byte_ids(tok))
    text_at = [k for k, i in enumerate(ids) if i not in specials and i not in byte_tokens]
    upto = text_at[-1] + 1 if text_at else 0
    run = bytes(_byte_ids(tok).index(i) for i in ids[upto:] if i in byte_tokens)
    try:
        run.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.reason != "unexpected end of data":
            upto = len(ids)  # NOTE: already invalid: one final U+FFFD per byte, whatever follows
    return tok.decode(ids[:upto], skip_special_tokens=True).encode()


def _surrogate_start(tok: Tokenizer) -> list[int]:
    """Byte tokens ED A0: a surrogate's first two bytes, invalid now, never completable."""
    byte_ids = _byte_ids(tok)
    return [byte_ids[0xED], byte_ids[0xA0]] if byte_ids else []


@pytest.mark.parametrize("family", ["byte_level_bpe", "sentencepiece_bpe", "metaspace_bpe"])
def test_k1_k2_k3_each_push_emits_every_character_already_final(family: str) -> None:
    """K1, K2, K3: for all id sequences (byte tokens, specials and partial characters
    included), after every push the bytes returned so far equal the final prefix of the
    output: nothing final is held back, nothing that may still change is sent."""
    tok = ALL_FAMILIES[family]()
    final = _final_byte_level if family == "byte_level_bpe" else _final_byte_fallback

    @settings(deadline=None, max_examples=examples(150))
    @given(st.lists(_ids_strategy(tok), max_size=30))
    @example(_surrogate_start(tok))
    def check(ids: list[int]) -> None:
        det = IncrementalDetokenizer(tok, skip_special_tokens=True)
        sent = b""
        for k, i in enumerate(ids):
            sent += det.push(i)
            assert sent == final(tok, ids[: k + 1]), (ids[: k + 1], sent)

    check()


def test_k2_a_removed_span_names_the_output_token_it_came_from() -> None:
    """K2: a skipped special token is recorded with its own output token index (0-based),
    here the third token's, 2."""
    tok = ALL_FAMILIES["byte_level_bpe"]()
    det = IncrementalDetokenizer(tok, skip_special_tokens=True)
    eos = tok.token_to_id("</s>")
    assert eos is not None
    for i in [*tok.encode("ab").ids, eos]:
        det.push(i)
    span = det.removed_spans[-1]
    assert span.reason == "special_token_skipped"
    assert span.index == len(tok.encode("ab").ids) == 2
