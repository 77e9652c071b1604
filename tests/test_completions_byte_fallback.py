"""Legacy completions logprobs over Gemma 3's byte fallback (SPEC P1, O1), through the
official ``openai`` client over loopback (skipped where ``/tmp/gemma3-270m-q4_k_m.gguf`` is
absent): a character outside the SentencePiece vocabulary is one ``<0xNN>`` token per byte,
each shown as U+FFFD. ``text_offset`` stays each token's start in the text (it moved one per
byte token, then stuck at the text's end), and the shared U+FFFD ``top_logprobs`` key holds
the best of its tokens' logprobs (it held the last, worst one)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.openai_sweep_support import model_of as _model
from tests.openai_sweep_support import serve

RARE = "\U00013000\U00013001 \ua66e"  # NOTE: Egyptian hieroglyphs, Cyrillic ꙮ: byte fallback


@pytest.fixture(scope="module")
def oa() -> Iterator[openai.OpenAI]:
    yield from serve("gemma3")


def test_o1_byte_fallback_offsets_and_shared_keys(oa: openai.OpenAI) -> None:
    """O1: every token's whole characters sit at its offset, a byte token at the character
    it is part of; a byte token's own logprob never exceeds its key's."""
    prompt = f"Repeat: {RARE} ok"
    r = oa.completions.create(model=_model(oa), prompt=prompt, max_tokens=0, echo=True,
                              logprobs=3)
    got, text = r.choices[0].logprobs, r.choices[0].text
    assert got is not None and text.endswith(prompt)
    assert got.tokens and got.text_offset and got.token_logprobs and got.top_logprobs
    assert got.tokens.count("\ufffd") >= 8  # NOTE: the hieroglyphs are byte tokens
    for token, at in zip(got.tokens, got.text_offset, strict=True):
        if token == "<bos>":
            continue
        whole = token.split("\ufffd")[0]
        assert text[at:at + len(whole)] == whole, (token, at, got.text_offset)
        if whole != token:
            assert text[at + len(whole)] in RARE, (token, at)
    assert got.text_offset[-1] == text.index(" ok")
    for token, own, top in zip(got.tokens[1:], got.token_logprobs[1:], got.top_logprobs[1:],
                               strict=True):
        assert own is not None and top is not None
        assert top.get(token, own) >= own - 1e-6, (token, own, top)
