"""Coda's SentencePiece tokenizer gives llama.cpp's ids for all vocabularies and texts (K1;
issue 19 item 1).

Small generated vocabularies make every hard case common: characters that are no pieces of
their own but sit inside pieces (llama.cpp merges through them, then falls back to bytes),
equal scores (llama.cpp merges the leftmost pair), several splits of one piece, multi-byte
characters. llama.cpp itself (``llama_cpp``, ``vocab_only``) is the oracle; without it the
property is skipped.
"""

from __future__ import annotations

import pickle
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.models.gguf_header import read_header
from coda.models.gguf_spm import spm_segments
from coda.models.tokenizer_bundle import bundle_from_gguf
from tests.conftest import examples
from tests.spm_vocab_fixture import write_pieces_gguf

CHARS = "ab▁é日本"
TEXT_CHARS = "ab é日本"

pieces_st = st.dictionaries(st.text(CHARS, min_size=1, max_size=4),
                            st.integers(-6, 0).map(float), min_size=1, max_size=30)


def _llama_ids(path: Path, text: str) -> list[int]:
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return list(ref.tokenize(text.encode(), add_bos=False, special=True))


@settings(max_examples=examples(60), deadline=None)
@given(pieces=pieces_st, texts=st.lists(st.text(TEXT_CHARS, max_size=16), min_size=1,
                                        max_size=4), space_prefix=st.booleans())
def test_k1_spm_ids_equal_llama_cpps_on_generated_vocabularies(
        pieces: dict[str, float], texts: list[str], space_prefix: bool) -> None:
    """K1: for every vocabulary (pieces, scores with ties, characters left out) and text,
    Coda's encode is llama.cpp's tokenize, and its pickled copy encodes the same."""
    pytest.importorskip("llama_cpp")
    with tempfile.TemporaryDirectory() as scratch:
        path = write_pieces_gguf(Path(scratch) / "v.gguf", sorted(pieces.items()), space_prefix)
        tok = bundle_from_gguf(read_header(path)).tokenizer
        copy = pickle.loads(pickle.dumps(tok))
        for text in texts:
            want = _llama_ids(path, text)
            assert tok.encode(text, add_special_tokens=False).ids == want, text
            assert copy.encode(text, add_special_tokens=False).ids == want, text


def test_k1_spm_merges_through_a_character_that_is_no_piece() -> None:
    """K1: "日本" is reached from "日" + "本" although "日" is no token; a lone "日" is bytes;
    of two equal-score merges the leftmost goes first."""
    scores = {"本": -1.0, "日本": -2.0, "ab": -3.0, "bc": -3.0, "a": -1.0, "b": -1.0, "c": -1.0}
    assert spm_segments("日本", scores) == [(0, 2)]
    assert spm_segments("日a", scores) == [(0, 1), (1, 2)]
    assert spm_segments("abc", scores) == [(0, 2), (2, 3)]
    assert spm_segments("", scores) == []


def test_k1_spm_tokenizer_serializes_as_its_bpe_table(tmp_path: Path) -> None:
    """The exact tokenizer still serializes (identity P1, llguidance, replicas): ``to_str``
    is the BPE table with the same vocabulary and decoder."""
    path = write_pieces_gguf(tmp_path / "v.gguf", [("本", -1.0), ("日本", -2.0)])
    tok = bundle_from_gguf(read_header(path)).tokenizer
    ids = tok.encode("日本日", add_special_tokens=False).ids
    assert ids == [tok.token_to_id("日本"), *(tok.token_to_id(f"<0x{b:02X}>")
                                              for b in "日".encode())]
    plain = type(tok).from_str(tok.to_str())
    assert plain.get_vocab() == tok.get_vocab()
    assert plain.decode(ids) == tok.decode(ids) == "日本日"


@settings(max_examples=examples(40), deadline=None)
@given(pieces=pieces_st, texts=st.lists(st.text(TEXT_CHARS, min_size=1, max_size=16),
                                        min_size=1, max_size=4), space_prefix=st.booleans())
def test_k1_the_grammar_engine_spells_text_as_the_model_does(
        pieces: dict[str, float], texts: list[str], space_prefix: bool) -> None:
    """K1, G: llguidance (which spells the budget closer's canonical completions) tokenizes a
    GGUF SentencePiece vocabulary's text exactly as Coda's encode does, and knows each id's
    bytes: a serialized lookup table would spell pieces the merging never reaches whole."""
    from coda.engine.grammar_tokenizer import ll_tokenizer

    with tempfile.TemporaryDirectory() as scratch:
        path = write_pieces_gguf(Path(scratch) / "v.gguf", sorted(pieces.items()), space_prefix)
        tok = bundle_from_gguf(read_header(path)).tokenizer
        ll = ll_tokenizer(tok, frozenset())
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False).ids
            assert ll.tokenize_str(text) == ids, text
            # NOTE: the bytes the grammar sees: the text as normalized (spaces, the prefix),
            # where pieces spell it (a byte-fallback "▁" stays the character's bytes)
            if not any((tok.id_to_token(i) or "").startswith("<0x") for i in ids):
                assert ll.decode_bytes(ids) == ((" " if space_prefix else "") + text).encode()
