"""Where each token's last byte lands in the detokenized text (SPEC K2, S2, S3; used by
:mod:`coda.output`).

A token's logprob entry goes with the delta that sends its LAST byte. Two counts decide it:
the bytes the detokenizer still holds (a partial character, an open byte run: it reports how
many of the last pushed tokens own them, ``IncrementalDetokenizer.held_tokens``) and, for the
tokens it released, where their last byte is in its output. Text length and piece length are
not comparable (an invalid byte's U+FFFD is three bytes for one; a stripped first space is
none for one), so the released tokens' pieces are decoded (UTF-8, each maximal invalid run one
U+FFFD, as the byte-level decoders do) and matched with the output: where they agree, a
token ends at the end of the character holding its last byte; where they do not (a decoder
that rewrites its pieces), every released token ends where the output released so far ends,
never earlier than its last byte. Offsets are absolute: pieces counted over every token,
output over every detokenized byte::

    pieces | released ........ | held tokens' pieces |        (from ``_p0``)
    output | attributed ..... | not yet attributed  |        (from ``_o0``)
"""

from __future__ import annotations


def _unit(data: bytes, i: int) -> tuple[int, int]:
    """Bytes and text bytes of the character at ``data[i]``: a valid one, or U+FFFD for a
    maximal invalid subpart (CPython's and Rust's ``from_utf8_lossy`` rule)."""
    try:
        data[i:i + 4].decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start == 0:
            return err.end, 3
    lead = data[i]
    n = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return n, n


def _spans(data: bytes) -> list[tuple[int, int]]:
    """``(piece end, text end)`` of each character of ``data`` decoded lossily."""
    out: list[tuple[int, int]] = []
    i = text = 0
    while i < len(data):
        n, m = _unit(data, i)
        i, text = i + n, text + m
        out.append((i, text))
    return out


def _common(a: bytes, b: bytes | bytearray) -> int:
    """Length of the common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class TokenEnds:
    """The output offsets of the pending tokens' last bytes, set once each is released."""

    def __init__(self) -> None:
        self._p0 = 0                       # piece offset of the first unattributed byte
        self._o0 = 0                       # output offset of the first unattributed byte
        self._pieces = bytearray()         # pieces from ``_p0`` on
        self._out = bytearray()            # output from ``_o0`` on
        self._held: list[int] = []         # piece end of each token not yet released
        # output offset -> piece offset where known (S3): (output, piece, length) runs that
        # map byte for byte, one of length 0 per character that does not
        self._marks: list[tuple[int, int, int]] = [(0, 0, 0)]

    def push(self, piece: bytes) -> None:
        """A token joins, unreleased, with its shown bytes."""
        self._pieces += piece
        self._held.append(self._p0 + len(self._pieces))

    def output(self, data: bytes) -> None:
        """The detokenizer produced ``data``."""
        self._out += data

    @property
    def out_end(self) -> int:
        """Output offset after every byte produced so far."""
        return self._o0 + len(self._out)

    def rewind(self, out_end: int, tokens: int) -> None:
        """An id sequence's own bytes and last ``tokens`` tokens are gone (S1, S3)."""
        del self._out[max(out_end - self._o0, 0):]
        self._o0 = min(self._o0, out_end)
        self._marks = [m for m in self._marks if m[0] + m[2] <= out_end]  # NOTE: gone bytes
        drop = min(tokens, len(self._held))
        if drop:
            del self._held[len(self._held) - drop:]
            keep = self._held[-1] if self._held else self._p0
            del self._pieces[max(keep - self._p0, 0):]

    def release(self, held: int, *, fallback: bool = True) -> list[int | None]:
        """All but the last ``held`` unreleased tokens are released: their ends, in order. A
        token whose characters the output does not (yet) match ends at ``out_end`` with
        ``fallback``; without it (a cut tail) it is left unreleased, None."""
        n = len(self._held) - held
        if n <= 0:
            return []
        if n == 1 == len(self._held) and self._pieces == self._out:
            # NOTE: the common case: one token, its text is its piece
            size = len(self._out)
            self._marks.append((self._o0, self._p0, size))
            self._held.clear()
            self._pieces.clear()
            self._out.clear()
            self._o0, self._p0 = self._o0 + size, self._p0 + size
            return [self._o0]
        ends: list[int | None] = []
        # NOTE: over every piece: a held token's bytes may complete a released one's character
        spans = _spans(bytes(self._pieces))
        same = self._matched()
        k = 0
        p_done = o_done = 0  # NOTE: relative to _p0/_o0: matched characters attributed
        for end in self._held[:n]:
            rel = end - self._p0
            while k < len(spans) and spans[k][0] < rel:
                k += 1
            if rel <= 0:
                ends.append(self._o0 + o_done)
                continue
            if k >= len(spans) or spans[k][1] > same:
                break
            p_done, o_done = spans[k]
            ends.append(self._o0 + o_done)
        for p, o in spans:
            if o > o_done:
                break
            self._marks.append((self._o0 + o, self._p0 + p, 0))
        left = n - len(ends)
        if left and fallback:
            p_done, o_done = self._held[n - 1] - self._p0, len(self._out)
            ends += [self._o0 + o_done] * left
            self._marks.append((self._o0 + o_done, self._p0 + p_done, 0))
        elif left:
            ends += [None] * left
            n -= left
        del self._held[:n], self._pieces[:p_done], self._out[:o_done]
        self._p0 += p_done
        self._o0 += o_done
        return ends

    def _matched(self) -> int:
        """Output bytes past ``_o0`` that the unattributed pieces, decoded lossily, agree with."""
        return _common(bytes(self._pieces).decode("utf-8", "replace").encode(), self._out)

    def piece_at(self, out: int, default: int) -> int:
        """The piece offset where output offset ``out`` ends, where known exactly (a stop's
        cut, S3; held tokens' characters too); else ``default``."""
        for o, p, size in reversed(self._marks):
            if o <= out <= o + size:
                return p + out - o
        same = self._matched()
        for p, o in _spans(bytes(self._pieces)):
            if o > same or self._o0 + o > out:
                break
            if self._o0 + o == out:
                return self._p0 + p
        return default

    def forget_before(self, out: int) -> None:
        """Offsets before ``out`` are sent: their marks are no longer needed."""
        keep = [m for m in self._marks if m[0] + m[2] >= out]
        if len(keep) < len(self._marks):
            self._marks = keep
