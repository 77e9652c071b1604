"""llama.cpp's SentencePiece segmentation, exactly (K1; issue 19 item 1).

A GGUF ``llama`` tokenizer is not the BPE its scores suggest. llama.cpp starts from the
text's characters (pieces or not), repeatedly merges the adjacent pair whose concatenation is
a vocabulary token of the highest score (equal scores: the leftmost pair), and only at the end
turns a symbol that is no token into its bytes (``<0xNN>``). So a piece is reachable through
characters that are not pieces of their own ("日" + "本" -> "日本" with no "日" token), and
equal-score merges go by position, not by rank. A ``tokenizers`` BPE table can express
neither: its merges join pieces only, and its ranks are total.

:func:`spm_segments` is that segmentation (written for Coda from the algorithm's description:
a bigram queue by score, stale entries skipped by size). :func:`exact_spm` puts it into a
``tokenizers.Tokenizer``'s encode: a second tokenizer with it as a custom pre-tokenizer in
front of a whole-piece BPE lookup encodes for the first, so callers keep one tokenizer type
with real :class:`~tokenizers.Encoding` objects, added tokens, normalizer and BOS template. A
custom pre-tokenizer cannot be serialized, so it stays out of the tokenizer callers see: its
parts and ``to_str`` are the plain whole-piece table it was built from (the same vocabulary
and decoder, for identity and replicas), and a pickled copy encodes exactly again. A grammar
engine, which must spell text as the model does, gets each id's bytes from
:func:`spm_token_bytes` and tokenizes through the exact encode.
"""

from __future__ import annotations

import heapq
import re
import weakref
from collections.abc import Mapping
from typing import Any

from tokenizers import NormalizedString, PreTokenizedString, Tokenizer, pre_tokenizers


def spm_segments(text: str, scores: Mapping[str, float]) -> list[tuple[int, int]]:
    """The ``(start, end)`` character spans llama.cpp's SPM merging leaves of ``text``:
    each span is a vocabulary token, or a single character that is none (byte fallback).

    ``scores`` maps every vocabulary text (any token type, as llama.cpp's lookup) to its
    score."""
    n = len(text)
    if n < 2:
        return [(0, n)] if n else []
    start = list(range(n))
    size = [1] * n
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prev = list(range(-1, n - 1))
    queue: list[tuple[float, int, int, int]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        width = size[left] + size[right]
        score = scores.get(text[start[left]:start[left] + width])
        if score is not None:
            # NOTE: heap order = llama.cpp's: highest score first, then the leftmost pair
            heapq.heappush(queue, (-score, left, right, width))

    for i in range(1, n):
        push(i - 1, i)
    while queue:
        _, left, right, width = heapq.heappop(queue)
        # NOTE: symbols only grow, so a pair whose sizes no longer add up is stale
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != width:
            continue
        size[left] = width
        size[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        push(prev[left], left)
        push(left, nxt[left])
    spans: list[tuple[int, int]] = []
    i = 0
    while i >= 0:
        spans.append((start[i], start[i] + size[i]))
        i = nxt[i]
    return spans


def _cut(s: NormalizedString, spans: list[tuple[int, int]], lo: int,
         out: list[NormalizedString | None]) -> None:
    """Append ``s``'s pieces at ``spans`` (contiguous character spans of the text ``s`` covers,
    which starts at ``lo``) to ``out``, in order.

    A ``NormalizedString`` slice costs the length of the string sliced, so slicing every span
    of a long text out of the whole took quadratic time (a 100k-character prompt 3 s, a 2 MB
    one about 20 minutes of a core, before the context check could refuse it). Halving first
    makes it O(n log n)."""
    if len(spans) <= 16:
        out.extend(s[a - lo:b - lo] for a, b in spans)
        return
    half = len(spans) // 2
    mid = spans[half][0]
    left, right = s[0:mid - lo], s[mid - lo:spans[-1][1] - lo]
    assert left is not None and right is not None  # NOTE: None only for a range outside s
    _cut(left, spans[:half], lo, out)
    _cut(right, spans[half:], mid, out)


class _SpmSplit:
    """The custom pre-tokenizer: one split per segment llama.cpp's merging leaves."""

    def __init__(self, scores: dict[str, float]) -> None:
        self.scores = scores

    def _split(self, _i: int, s: NormalizedString) -> list[NormalizedString]:
        parts: list[NormalizedString | None] = []
        _cut(s, spm_segments(str(s), self.scores), 0, parts)
        return [p for p in parts if p is not None]  # NOTE: spans are never empty

    def pre_tokenize(self, pretok: PreTokenizedString) -> None:
        pretok.split(self._split)


def exact_spm(plain: Tokenizer, scores: dict[str, float],
              lookup: Tokenizer | None = None) -> Tokenizer:
    """``plain`` (an SPM tokenizer: normalizer, byte-fallback BPE, decoder, added tokens),
    encoding with llama.cpp's segmentation. Returned as the same object: its parts, ``to_str``
    and decoding stay the plain table's. ``lookup`` is ``plain``'s pipeline over a BPE model
    with ``ignore_merges`` (built from ``plain`` when not given)."""
    exact = lookup if lookup is not None else Tokenizer.from_str(plain.to_str())
    # NOTE: every segment is a whole token (looked up as is) or one character that is none
    # (its bytes), so the BPE merges never run
    exact.model.ignore_merges = True
    exact.pre_tokenizer = pre_tokenizers.PreTokenizer.custom(_SpmSplit(scores))

    def reduce_ex(_protocol: Any) -> tuple[Any, ...]:
        return (_rebuild, (Tokenizer.to_str(plain), scores))

    # NOTE: instance attributes (Tokenizer instances carry a __dict__) shadow the class's
    # methods; the parts stay serializable (identity, llguidance, admission's prompt bound)
    plain.encode = exact.encode  # type: ignore[method-assign]
    plain.encode_batch = exact.encode_batch  # type: ignore[method-assign]
    plain.encode_batch_fast = exact.encode_batch_fast  # type: ignore[method-assign]
    plain.__reduce_ex__ = reduce_ex  # type: ignore[method-assign]
    _EXACT.add(plain)
    return plain


_EXACT: weakref.WeakSet[Tokenizer] = weakref.WeakSet()


def is_exact_spm(tok: Any) -> bool:
    """Whether ``tok`` encodes through :func:`exact_spm` (each piece a whole vocabulary
    token or one character's bytes)."""
    return isinstance(tok, Tokenizer) and tok in _EXACT


_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def spm_token_bytes(tok: Tokenizer) -> tuple[list[bytes], list[int]] | None:
    """For a tokenizer :func:`exact_spm` made: each id's bytes and the special ids, for a
    grammar engine that must tokenize as the model does (llguidance's ``TokenizerWrapper``:
    special tokens marked by a leading 0xFF, as its llama.cpp binding does). None for any other
    tokenizer (its serialized form already encodes as it does)."""
    if tok not in _EXACT:
        return None
    special = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    marked = set(special)
    out: list[bytes] = []
    for i in range(tok.get_vocab_size()):
        text = tok.id_to_token(i) or ""
        byte = _BYTE_TOKEN.fullmatch(text)
        if i in marked:
            out.append(b"\xff" + text.encode())
        elif byte is not None:  # NOTE: byte fallback's tokens (no piece is spelled <0xNN>)
            out.append(bytes([int(byte.group(1), 16)]))
        else:
            out.append(text.replace("\u2581", " ").encode())
    return out, special


def _rebuild(serialized: str, scores: dict[str, float]) -> Tokenizer:
    return exact_spm(Tokenizer.from_str(serialized), scores)
