"""The detokenizer's cut drain and its token pieces, unit by unit (K2, K3, K4, S1; issue 20
K3 ``auto``, issue 11 logprob pieces). The engine-level tests reach these through the output
processor; here each branch is pinned directly, so a defect in one is named by one test."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from coda import detokenizer, detokenizer_profile
from coda.detokenizer import IncrementalDetokenizer, RemovedSpan, profile_of
from tests.tokenizer_fixtures import byte_level_bpe, sentencepiece_bpe


@pytest.fixture(autouse=True)
def _fresh_profiles() -> None:
    """A profile cached by an earlier test would hide a defect in building one (K1)."""
    detokenizer._PROFILES.clear()


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in data]
    assert None not in ids
    return [i for i in ids if i is not None]


def _fed(tok: Tokenizer, ids: list[int]) -> tuple[IncrementalDetokenizer, bytes]:
    det = IncrementalDetokenizer(tok, prompt_token_ids=tok.encode("Hi").ids)
    out = b"".join(det.push(i) for i in ids)
    return det, out


def test_k3_finish_cut_removes_a_partial_last_character_and_names_the_span() -> None:
    """K3 auto: text then the first two bytes of 日 (byte fallback): the cut keeps the whole
    characters and removes exactly the partial one, recorded as one ``incomplete_tail`` span
    that is not tied to a token."""
    tok = sentencepiece_bpe()
    det, out = _fed(tok, tok.encode("ok", add_special_tokens=False).ids + _byte_ids(tok, b"\xe6\x97"))
    text, cut = det.finish_cut()
    assert out + text == b" ok" or out + text == b"ok"
    assert cut == b"\xe6\x97"
    assert det.removed_spans[-1] == RemovedSpan(-1, -1, "incomplete_tail", b"\xe6\x97")


def test_k3_finish_cut_keeps_whole_fallback_characters_before_the_partial_one() -> None:
    """A byte-fallback run of é (whole) then half of é: the whole one is text, the half cut."""
    tok = sentencepiece_bpe()
    det, out = _fed(tok, _byte_ids(tok, b"\xc3\xa9\xc3"))
    text, cut = det.finish_cut()
    assert out + text == "é".encode() and cut == b"\xc3"


def test_k3_finish_cut_with_a_whole_tail_cuts_nothing() -> None:
    tok = sentencepiece_bpe()
    det, out = _fed(tok, _byte_ids(tok, "日".encode()))
    text, cut = det.finish_cut()
    assert out + text == "日".encode() and cut == b""
    assert not any(s.reason == "incomplete_tail" for s in det.removed_spans)


def test_k3_finish_cut_byte_level_partial_character() -> None:
    """Byte-level BPE: a token holding the first byte of 😀 alone is cut the same way."""
    tok = byte_level_bpe()
    first = bytes([0xF0])
    # NOTE: GPT-2's byte alphabet maps 0xF0 to one printable character, a token of its own
    char = {b: c for c, b in detokenizer_profile._byte_level_table().items()}[0xF0]
    lead = tok.token_to_id(char)
    assert lead is not None
    det, out = _fed(tok, tok.encode("ok", add_special_tokens=False).ids + [lead])
    text, cut = det.finish_cut()
    assert cut == first and (out + text).endswith(b"ok")
    assert det.removed_spans[-1] == RemovedSpan(-1, -1, "incomplete_tail", first)


def test_s1_fork_is_independent_of_its_source() -> None:
    """S1: the fork kept before an id that may begin a stop id sequence drains the text up to
    that id, whatever the source consumes afterwards (its window and spans are its own)."""
    tok = sentencepiece_bpe()
    det, out = _fed(tok, _byte_ids(tok, b"\xe6"))
    twin = det.fork()
    for i in _byte_ids(tok, b"\x97\xa5") + tok.encode(" after", add_special_tokens=False).ids:
        det.push(i)
    det.finish()
    assert twin.finish_cut() == (b"", b"\xe6")
    assert [s.reason for s in twin.removed_spans].count("incomplete_tail") == 1
    assert not any(s.reason == "incomplete_tail" for s in det.removed_spans)


def test_k4_piece_of_a_special_token_is_its_text() -> None:
    """K4 (logprobs' bytes): a special token's piece is its own text, never the empty string a
    special-skipping decode would give."""
    tok = sentencepiece_bpe()
    special = tok.token_to_id("</s>")
    assert special is not None
    assert profile_of(tok).piece(special) == b"</s>"


def test_k4_piece_without_an_anchor_letter_is_the_lone_decode() -> None:
    """A vocabulary with no plain letter to anchor on: the piece is the token's own decode."""
    tok = Tokenizer(models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken("[UNK]", special=True)])
    assert profile_of(tok).piece(1) == b"world" and profile_of(tok).piece(0) == b"hello"
    assert profile_of(tok).piece(2) == b"[UNK]"  # a special token's piece is its text here too


def test_k4_anchor_is_a_plain_letter_never_a_special_token() -> None:
    """The anchor is looked up once per profile and skips special tokens: with ``a`` special,
    a SentencePiece ``▁word`` piece still keeps its space."""
    tok = sentencepiece_bpe()
    profile = detokenizer.profile_of(tok)
    anchor = profile._anchor()
    assert anchor is not None and anchor not in profile.special_ids
    assert profile._anchor() == anchor  # cached
    word = next(t for t in sorted(tok.get_vocab()) if t.startswith("▁") and t[1:].isalpha())
    assert profile.piece(tok.token_to_id(word)) == b" " + word[1:].encode()


def test_k4_profile_is_built_once_per_tokenizer() -> None:
    """K4: a tokenizer's profile (its pieces and views) is cached: every call for the same
    tokenizer returns the same profile, which holds that tokenizer."""
    tok = sentencepiece_bpe()
    assert profile_of(tok) is profile_of(tok) and profile_of(tok).tokenizer is tok
