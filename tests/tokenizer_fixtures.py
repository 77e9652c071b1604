"""Tiny real tokenizers for the detokenizer tests (SPEC K1-K4).

Each builder trains (or hand-assembles) a small ``tokenizers.Tokenizer`` on a multilingual
corpus with CJK, accented Latin, emoji and a genuine U+FFFD, so that multi-byte characters
really are split across tokens. Builders are cached: each costs about 0.1 s once.

Families (``ALL_FAMILIES``):
- ``byte_level_bpe``: GPT-2 / Llama-3 / Qwen style (ByteLevel pre-tokenizer and decoder).
- ``sentencepiece_bpe``: Llama-2 / Mistral style (Metaspace-like normaliser, BPE with
  byte_fallback and ``<0xNN>`` tokens; decoders Replace(▁→space), ByteFallback, Fuse, Strip).
- ``metaspace_bpe``: same model with the ``Metaspace`` decoder (per-token leading-space rule).
- ``wordpiece``: BERT style, NFKC + lowercase normaliser, ``##`` continuation and cleanup.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)

SPECIAL_TOKENS = ["<s>", "</s>", "<|endoftext|>"]
# NOTE: an added token that is NOT special: skip_special_tokens must keep it.
PLAIN_ADDED = "<tool>"

_LINES = [
    "The quick brown fox jumps over the lazy dog. Don't stop!",
    "Café crème, naïve façade, déjà vu, Ångström, über straße.",
    "日本語のテキストを分割します。中文分词测试，你好世界。",
    "한국어 문장도 조금 넣습니다.",
    "Emoji: 😀 🎉 👍🏽 🇫🇷 🤖 and ❤️ hearts.",
    "Replacement char \ufffd stays \ufffd here.",
    "Numbers 12345 and symbols #@$%^&*() are fine?",
    "Ελληνικά και русский текст тоже.",
]
CORPUS: list[str] = [line for _ in range(6) for line in _LINES]


def _add_specials(tok: Tokenizer) -> Tokenizer:
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(PLAIN_ADDED, special=False)])
    return tok


@cache
def byte_level_bpe() -> Tokenizer:
    """GPT-2 / Llama-3 / Qwen family: bytes mapped to a printable alphabet."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return _add_specials(tok)


@cache
def _sentencepiece_model() -> tuple[dict[str, int], tuple[tuple[str, str], ...]]:
    """Train a char BPE on ▁-joined text, then append the 256 ``<0xNN>`` byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    # NOTE: limit_alphabet keeps rare CJK/emoji characters out, so they need byte fallback.
    trainer = trainers.BpeTrainer(vocab_size=300, limit_alphabet=60, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    spec = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(spec["vocab"])
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    for byte in range(256):
        # NOTE: ordinary vocabulary entries, never special tokens, or decode() would drop them.
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    vocab.setdefault("\ufffd", len(vocab))
    # NOTE: cached and shared by two families, so the vocabulary must be identical for both.
    return vocab, tuple((a, b) for a, b in merges)


def _sentencepiece(decoder: decoders.Decoder) -> Tokenizer:
    vocab, merges = _sentencepiece_model()
    tok = Tokenizer(models.BPE(vocab=dict(vocab), merges=list(merges), byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoder
    return _add_specials(tok)


@cache
def sentencepiece_bpe() -> Tokenizer:
    """Llama-2 / Mistral family: Replace ▁→space, ByteFallback, Fuse, Strip one leading space."""
    return _sentencepiece(
        decoders.Sequence(
            [
                decoders.Replace("▁", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    )


@cache
def metaspace_bpe() -> Tokenizer:
    """Newer SentencePiece exports: ByteFallback then the Metaspace decoder (first-token rule)."""
    return _sentencepiece(
        decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace(replacement="▁", prepend_scheme="always")]
        )
    )


@cache
def wordpiece() -> Tokenizer:
    """BERT family: NFKC + lowercase normaliser, ``##`` continuations, decoder cleanup."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    trainer = trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=["[UNK]"], show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return _add_specials(tok)


ALL_FAMILIES: dict[str, Callable[[], Tokenizer]] = {
    "byte_level_bpe": byte_level_bpe,
    "sentencepiece_bpe": sentencepiece_bpe,
    "metaspace_bpe": metaspace_bpe,
    "wordpiece": wordpiece,
}
