"""``IncrementalDetokenizer.held_tokens`` (K2): how many of the last pushed output tokens own
bytes the detokenizer still holds, the count :mod:`coda.token_ends` reads to keep a token's
entry until its last byte is out. Pinned here directly (the output processor's tests reach it
only through whole deltas), on a byte-fallback tokenizer's ``日`` (bytes 0xe6 0x97 0xa5) split into its
byte tokens."""

from __future__ import annotations

import contextlib

from tokenizers import Tokenizer

from coda.detokenizer import IncrementalDetokenizer
from tests.tokenizer_fixtures import sentencepiece_bpe


def _byte_ids(tok: Tokenizer, data: bytes) -> list[int]:
    ids = [tok.token_to_id(f"<0x{b:02X}>") for b in data]
    assert None not in ids
    return [i for i in ids if i is not None]


def _det(tok: Tokenizer, prompt: list[int] | None = None) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tok, prompt_token_ids=prompt or tok.encode("Hi").ids)


def test_k2_held_tokens_count_the_tokens_of_the_open_run() -> None:
    """K2: none before any push and after text that is out; one, two, three while 日's byte
    tokens arrive (a byte-fallback run stays open until a text token follows); none once the
    next text token closes the run."""
    tok = sentencepiece_bpe()
    det = _det(tok)
    assert det.held_tokens == 0
    space, o = tok.token_to_id("\u2581"), tok.token_to_id("o")
    assert space is not None and o is not None
    assert det.push(space) + det.push(o) == b" o" and det.held_tokens == 0
    for held, i in enumerate(_byte_ids(tok, "日".encode()), start=1):
        assert det.push(i) == b"" and det.held_tokens == held
    assert det.push(space) == "日 ".encode() and det.held_tokens == 0


def test_k2_held_tokens_never_count_prompt_tokens() -> None:
    """K2: a prompt ending inside a character: the open run spans the prompt's last token and
    the first output token, but only the output token is held (its count caps the run)."""
    tok = sentencepiece_bpe()
    e6, x97, _ = _byte_ids(tok, "日".encode())
    det = _det(tok, [*tok.encode("Hi").ids, e6])
    det.push(x97)
    assert det.held_tokens == 1


def test_k2_held_tokens_are_none_after_the_tail_is_drained_or_dropped() -> None:
    """K2: ``finish`` (a normal end) and ``discard_pending`` (a stop hit) leave no held
    token, whatever was open."""
    tok = sentencepiece_bpe()
    e6, x97, _ = _byte_ids(tok, "日".encode())
    for end in ("finish", "discard_pending"):
        det = _det(tok)
        det.push(e6)
        det.push(x97)
        assert det.held_tokens == 2
        with contextlib.suppress(Exception):  # NOTE: finish may refuse the invalid tail (K3)
            getattr(det, end)()
        assert det.held_tokens == 0, end
