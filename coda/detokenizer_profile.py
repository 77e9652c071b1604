"""A tokenizer's profile: its byte mode and the byte view of each id (SPEC K1, K3, K4, K2).

Per-tokenizer facts shared by every request's :class:`coda.detokenizer.IncrementalDetokenizer`:
where raw bytes (possibly partial characters, K3) come from in this tokenizer's decode
(:class:`ByteMode`), its special ids, and each id's byte view, filled lazily: a BYTE_LEVEL
token's raw bytes (the GPT-2 byte alphabet), the byte of a ``<0xNN>`` byte-fallback token, or
-1 for a whole-character token. The detokenizer decides what it holds back (K1) from these
views, never from the decoded text. :meth:`TokenizerProfile.piece` is a token's exact bytes in
the middle of a text (a logprob entry's ``bytes``, K2), decoded after an anchor token so the
first-token cleanup rules (K4) do not apply. The profile of a tokenizer is cached
(:func:`coda.detokenizer.profile_of`): do not mutate a tokenizer after its first detokenizer.
"""

from __future__ import annotations

import re
from enum import StrEnum

import tokenizers
from tokenizers import pre_tokenizers

_BYTE_TOKEN = re.compile(r"<0x[+0-9A-Fa-f][0-9A-Fa-f]>")  # NOTE: what ByteFallback accepts


class ByteMode(StrEnum):
    """Where raw bytes (possibly partial characters) come from in this tokenizer's decode."""

    BYTE_LEVEL = "byte_level"  # GPT-2 alphabet: every token is bytes, decode is lossy UTF-8
    BYTE_FALLBACK = "byte_fallback"  # runs of <0xNN> tokens, an invalid run becomes n x U+FFFD
    TEXT = "text"  # tokens are whole characters: nothing is ever partial




def _byte_level_table() -> dict[str, int]:
    # NOTE: the GPT-2 byte alphabet: printable bytes map to themselves, others shift past 255.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table = {chr(b): b for b in keep}
    shift = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + shift)] = b
            shift += 1
    assert set(table) == set(pre_tokenizers.ByteLevel.alphabet())
    return table


_BYTE_LEVEL_TABLE = _byte_level_table()


class TokenizerProfile:
    """Per-tokenizer facts shared by all requests: byte mode, special ids, byte views (cached)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = tokenizer.decoder
        spec = decoder.__getstate__().decode() if decoder is not None else ""
        if '"type":"ByteLevel"' in spec:
            self.mode = ByteMode.BYTE_LEVEL
        elif '"type":"ByteFallback"' in spec:
            self.mode = ByteMode.BYTE_FALLBACK
        else:
            self.mode = ByteMode.TEXT
        self.strips_leading_space = '"type":"Strip"' in spec or '"type":"Metaspace"' in spec
        added = tokenizer.get_added_tokens_decoder()
        self.special_ids = frozenset(i for i, tok in added.items() if tok.special)
        # NOTE: one lazily filled table per skip flag, shared by every request.
        self.views = {flag: _Views(self, flag) for flag in (False, True)}
        self._pieces: dict[int, bytes] = {}
        self._anchor_id: int | None | bool = False  # NOTE: False: not looked up yet

    def piece(self, token_id: int) -> bytes:
        """The exact bytes ``token_id`` adds to a text it continues (logprobs' ``bytes``).

        BYTE_LEVEL tokens and ``<0xNN>`` tokens are their byte view. Any other token is decoded
        after an anchor token and the anchor's own text removed: decoding a token alone would
        apply the first-token rules (SentencePiece/Metaspace strip the leading space, so
        ``▁x`` would read ``x``), which do not hold for a token in the middle of the output."""
        found = self._pieces.get(token_id)
        if found is None:
            found = self._pieces[token_id] = self._piece(token_id)
        return found

    def _piece(self, token_id: int) -> bytes:
        view = self.view(token_id)
        if isinstance(view, bytes):
            return view
        if isinstance(view, int) and view >= 0:
            return bytes([view])
        alone = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        anchor = self._anchor()
        if anchor is None:
            return alone
        head = self.tokenizer.decode([anchor], skip_special_tokens=False).encode()
        both = self.tokenizer.decode([anchor, token_id], skip_special_tokens=False).encode()
        # NOTE: a decoder that rewrites across the boundary: the lone decode is the best answer
        return both[len(head):] if both.startswith(head) else alone

    def _anchor(self) -> int | None:
        """A plain letter token (decodes to the same ASCII letter alone and after itself)."""
        if self._anchor_id is not False:
            return self._anchor_id
        self._anchor_id = None
        for text in ("a", "e", "x", "A", "▁a", "Ġa"):
            i = self.tokenizer.token_to_id(text)
            if i is None or i in self.special_ids:
                continue
            one = self.tokenizer.decode([i], skip_special_tokens=False)
            if one.strip().isascii() and one.strip().isalpha():
                self._anchor_id = i
                break
        return self._anchor_id

    def view(self, token_id: int) -> bytes | int | None:
        """BYTE_LEVEL: the token's raw bytes. BYTE_FALLBACK: the byte of a <0xNN> token, else -1.
        TEXT: -1. None: the id is unknown (decode() ignores it)."""
        return self.views[False][token_id]


class _Views(dict[int, bytes | int | None]):
    """id -> byte view as in :meth:`TokenizerProfile.view`; None when decode() drops the id."""

    def __init__(self, profile: TokenizerProfile, skip_special: bool) -> None:
        super().__init__()
        self._profile, self._skip = profile, skip_special

    def __missing__(self, token_id: int) -> bytes | int | None:
        profile = self._profile
        token = profile.tokenizer.id_to_token(token_id)
        result: bytes | int | None
        if token is None or (self._skip and token_id in profile.special_ids):
            result = None
        elif profile.mode is ByteMode.BYTE_LEVEL:
            # NOTE: like the ByteLevel decoder: alphabet bytes if every char maps, else UTF-8.
            mapped = [_BYTE_LEVEL_TABLE.get(c) for c in token]
            ok = all(m is not None for m in mapped)
            result = bytes(m for m in mapped if m is not None) if ok else token.encode()
        elif profile.mode is ByteMode.BYTE_FALLBACK and _BYTE_TOKEN.fullmatch(token):
            result = int(token[3:5], 16)
        else:
            result = -1
        self[token_id] = result
        return result
