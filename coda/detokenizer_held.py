"""What the detokenizer holds back, read from byte views, and what a cut leaves of it (SPEC K1, K3).

The held tail (K1's undecoded bytes) is never read from the decoded text: it is read from the
byte views of the window's last tokens (:mod:`coda.detokenizer_profile`). A BYTE_LEVEL
tokenizer holds at most one incomplete (still valid) UTF-8 character (:func:`held_utf8`,
:func:`byte_level_tail`); a BYTE_FALLBACK one holds an open run of ``<0xNN>`` tokens that one
more byte could still turn into U+FFFDs (:func:`byte_run_tail`). Both are the slow paths of
:meth:`coda.detokenizer.IncrementalDetokenizer._analyse_tail`, which keeps the fast ones (a
tail ending in ASCII, a text token closing the run). Where a budget or a stop id sequence cut
the output (``utf8_tail: auto``, K3), :func:`cut_residue` keeps the whole characters of a
residue ``finish()`` refused and names the incomplete character the cut left.
"""

from __future__ import annotations

import codecs
from collections.abc import Mapping, Sequence

from coda.errors import DecodingError

Views = Mapping[int, bytes | int | None]
"""id -> byte view (:meth:`coda.detokenizer_profile.TokenizerProfile.view`)."""


def held_utf8(data: bytes) -> int:
    """How many trailing bytes of ``data`` are an incomplete (still valid) UTF-8 character."""
    tail = data[-3:]
    # NOTE: a lead byte restarts decoding, so the last 3 bytes decide; consumed < len = held.
    held = len(tail) - codecs.utf_8_decode(tail, "replace", False)[1]
    # NOTE: CPython also holds ED A0-BF (a surrogate's first two bytes), which no byte can
    # complete: those are final U+FFFDs now. A partial character completes with 80-BF bytes.
    if held >= 2 and not _completable(tail[-held:]):
        return 0
    return held


def _completable(part: bytes) -> bool:
    """Whether some continuation bytes make ``part`` (a lead byte and 1-2 continuation bytes)
    one well-formed UTF-8 character."""
    for n in range(1, 3):
        try:
            (part + b"\x80" * n).decode("utf-8")
            return True
        except UnicodeDecodeError:
            continue
    return False


def byte_level_tail(window: Sequence[int], views: Views) -> tuple[bytes, int]:
    """BYTE_LEVEL: the held incomplete character and the window index of the token holding its
    first byte; ``(b"", len(window))`` when the window ends on a whole character."""
    data, i = b"", len(window)
    while i > 0 and len(data) < 3:
        i -= 1
        v = views[window[i]]
        if isinstance(v, bytes):
            data = v + data
    held = held_utf8(data)
    if held:
        return data[-held:], _byte_owner(window, views, held)
    return b"", len(window)


def _byte_owner(window: Sequence[int], views: Views, held: int) -> int:
    """BYTE_LEVEL: window index of the token holding the first of the last ``held`` bytes."""
    i = len(window)
    while held > 0:
        i -= 1
        v = views[window[i]]
        if isinstance(v, bytes):
            held -= len(v)
    return i


def byte_run_tail(window: Sequence[int], views: Views) -> tuple[bytes, int, int]:
    """BYTE_FALLBACK: the open byte run ending the window, its start index and the characters
    it renders as now; ``(b"", len(window), 0)`` when there is none to hold."""
    run: list[int] = []
    i = len(window)
    while i > 0:
        v = views[window[i - 1]]
        if isinstance(v, int):
            if v < 0:
                break
            run.append(v)
        i -= 1
    if not run:
        return b"", len(window), 0
    raw = bytes(reversed(run))
    try:
        chars = len(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        if err.reason != "unexpected end of data":
            # NOTE: already invalid: every byte is a final U+FFFD, emit them
            return b"", len(window), 0
        chars = len(raw)  # NOTE: an incomplete run renders as one U+FFFD per byte
    return raw, i, chars


def cut_residue(pending: bytes, byte_level: bool) -> bytes:
    """The whole characters of a residue ``finish()`` refused, where a cut ended the output;
    the rest (``pending`` after them) is the incomplete character the cut left. A residue
    that no byte could complete raises DecodingError (K3)."""
    # NOTE: a byte-level residue is one partial character; a byte-fallback run is whole
    # characters then at most one partial one (an earlier error would have emitted it)
    held = held_utf8(pending)
    keep = pending[: len(pending) - held]
    try:
        keep.decode("utf-8")
    except UnicodeDecodeError:
        held = 0
    if not held or (byte_level and keep):
        raise DecodingError(f"incomplete UTF-8 at end of output: {pending.hex()}")
    return keep
