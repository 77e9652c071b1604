"""A generated SentencePiece vocabulary the size of Gemma 3's, written as a GGUF (issue 19).

Real SPM vocabularies are large (Gemma 3: 262,144 pieces) and their tie-breaking, byte
fallback and long-piece merges only show at that size. :func:`write_spm_vocab_gguf` builds one
deterministically (a seeded ``random.Random``: the same bytes on every machine and Python):

* Gemma's layout: ``<pad>`` ``<eos>`` ``<bos>`` ``<unk>`` ``<mask>`` control tokens, a
  user-defined ``<start_of_turn>``/``<end_of_turn>`` pair, then the 256 ``<0xNN>`` byte tokens;
* every substring (up to 8 characters, spaces as ``▁``) of a multilingual corpus — the pieces
  a trained model would hold — then random pieces over Latin, Cyrillic, Greek, CJK, Hangul and
  emoji characters up to the size; some pieces are left out so byte fallback is exercised;
* scores that fall with the piece's rank, with runs of equal scores (ties occur in trained
  vocabularies: the merge order between equal-score pairs must match llama.cpp's).

The file holds the tokenizer metadata and the hyperparameters llama.cpp reads with
``vocab_only`` (a ``llama`` architecture, no tensors): a tokenizer oracle, not a model.
"""

from __future__ import annotations

import random
from pathlib import Path

import gguf

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
USER_DEFINED = ["<start_of_turn>", "<end_of_turn>"]

CORPUS = (
    "Hello world! What is the capital of France? The quick brown fox jumps over the lazy dog.",
    "café naïve résumé coöperate Ångström Øresund façade jalapeño über straße déjà vu",
    "日本語のテキストと中文文本，还有한국어 문장도 있습니다。東京は日本の首都です。",
    "Русский текст и ελληνικά και العربية وעברית — mixed scripts in one line.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n",
    "Emoji: 😀 👍🏽 🇫🇷 ❤️ 🤖✨ numbers 1234567890 and π ≈ 3.14159",
    "{\"key\": [1, 2, 3], \"nested\": {\"a\": null}} https://example.com/path?q=1&x=two#frag",
)
_ALPHABETS = (
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "абвгдежзийклмнопрстуфхцчшщъыьэюяАБВГДЕЖЗИЙКЛМН",
    "αβγδεζηθικλμνξοπρστυφχψω",
    "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年",
    "のにはをたがでてとしれさあいうえおかきくけこ",
    "한국어문장도조금넣습니다가나다라마바사",
    "0123456789 .,;:!?'\"()-",
)


def generated_pieces(size: int, seed: int = 0) -> list[tuple[str, float]]:
    """``size`` distinct (piece, score) pairs, highest score first, deterministic in seed."""
    rng = random.Random(seed)
    seen: dict[str, None] = {}
    for line in CORPUS:
        text = line.replace(" ", "▁")
        for n in range(1, 9):
            for i in range(len(text) - n + 1):
                seen.setdefault(text[i:i + n], None)
    # NOTE: leave ~3% of the corpus pieces (never single characters of ASCII) out, so some
    # text must fall back to bytes or to shorter pieces
    pieces = [p for p in seen if len(p) == 1 and p.isascii() or rng.random() > 0.03]
    have = set(pieces)
    while len(pieces) < size:
        alphabet = rng.choice(_ALPHABETS)
        p = ("▁" if rng.random() < 0.4 else "") + "".join(
            rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
        if p not in have:
            have.add(p)
            pieces.append(p)
    pieces = pieces[:size]
    scores: list[float] = []
    score = 0.0
    for _ in pieces:
        if rng.random() > 0.15:  # NOTE: ~15% of pieces tie with the one before them
            score -= 1.0
        scores.append(score)
    order = list(range(len(pieces)))
    rng.shuffle(order)  # NOTE: ranks are not the corpus order
    return [(pieces[i], s) for i, s in zip(order, scores, strict=True)]


def add_gemma_spm_vocab(w: gguf.GGUFWriter, tokens: list[str], types: list[int],
                        scores: list[float], space_prefix: bool = False) -> None:
    """A SentencePiece vocabulary in Gemma's layout: ``<pad>`` 0, ``<eos>`` 1, ``<bos>`` 2,
    ``<unk>`` 3, BOS added, no space prefix (unless ``space_prefix``)."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(space_prefix)


def write_spm_vocab_gguf(path: Path, size: int = 262_144, seed: int = 0) -> Path:
    """Write the generated vocabulary (``size`` tokens in all) as a vocab-only GGUF."""
    fixed = len(SPECIALS) + len(USER_DEFINED) + 256
    return write_pieces_gguf(path, generated_pieces(size - fixed, seed))


def write_pieces_gguf(path: Path, pieces: list[tuple[str, float]],
                      space_prefix: bool = False) -> Path:
    """Write a vocab-only GGUF of Gemma's special and byte tokens followed by ``pieces``
    (normal tokens, with their scores)."""
    fixed = len(SPECIALS) + len(USER_DEFINED) + 256
    tokens = SPECIALS + USER_DEFINED + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in pieces]
    types = [3] * len(SPECIALS) + [4] * len(USER_DEFINED) + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * fixed + [s for _, s in pieces]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("generated spm vocabulary")
    w.add_block_count(1)
    w.add_context_length(4096)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    add_gemma_spm_vocab(w, tokens, types, scores, space_prefix)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
