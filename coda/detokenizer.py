"""Incremental byte detokenizer (SPEC K1-K4, G2).

``IncrementalDetokenizer.push(id)`` returns exactly the new UTF-8 bytes that are final, so that
``concat(push...) + finish() == tokenizer.decode(ids).encode()`` (K2; with a prompt, the text is
decoded in the prompt's context and never echoed: docs/output-text.md). The declared interface is ``tokenizer.decode``: invalid bytes
in the middle of the output become U+FFFD exactly as decode() makes them; the one deviation is at
``finish()``, where an incomplete or invalid residue raises :class:`DecodingError` (K3) instead
of producing a trailing U+FFFD.

Method (measured against ``tokenizers.decoders.DecodeStream``, which decides "incomplete" by a
trailing U+FFFD and so holds a genuine U+FFFD token back): a short window of ids is re-decoded
by the tokenizer itself, so every neighbour-dependent cleanup rule (K4: SentencePiece leading
space, Metaspace first-token rule, WordPiece ``##``/cleanup, byte fallback) is the tokenizer's
own. What is held back is decided from a real byte view of the trailing tokens, never from the
text: the held-back part is ``unstable``, everything before it has been emitted::

    window ids:   | context (already emitted) | emitted ... | unstable tail |
    window text:  |<------- emitted_chars -------------------->|<- pending ->|

The window is cut back to a clean token boundary (one that cannot split a UTF-8 character or a
byte-token run) when it grows, so a push costs one decode of at most ``_MAX_WINDOW`` + 1 ids:
O(1) per token. Measured on 100k tokens of the test fixtures (2 shared CPU cores): 3-5 us per
push (DecodeStream: 1-2.5 us, but wrong on genuine U+FFFD and it loses the tail at the end).

Byte-fallback runs (``<0xNN>`` tokens) are decoded as one group by decode(): a run that is
still valid is held until a text token closes it (or finish()), because one more byte could
turn the whole run into U+FFFD; a run that is already invalid is emitted at once. The profile
of a tokenizer is cached: do not mutate a tokenizer after its first detokenizer.
"""

from __future__ import annotations

import codecs
import copy
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import tokenizers
from tokenizers import pre_tokenizers

from coda.errors import DecodingError

_MAX_WINDOW = 6  # NOTE: window length that triggers a cut back to a clean boundary
_MIN_CONTEXT = 1  # NOTE: rendered tokens kept before the unstable tail after a cut
_BYTE_TOKEN = re.compile(r"<0x[+0-9A-Fa-f][0-9A-Fa-f]>")  # NOTE: what ByteFallback accepts


class ByteMode(StrEnum):
    """Where raw bytes (possibly partial characters) come from in this tokenizer's decode."""

    BYTE_LEVEL = "byte_level"  # GPT-2 alphabet: every token is bytes, decode is lossy UTF-8
    BYTE_FALLBACK = "byte_fallback"  # runs of <0xNN> tokens, an invalid run becomes n x U+FFFD
    TEXT = "text"  # tokens are whole characters: nothing is ever partial


@dataclass(frozen=True)
class RemovedSpan:
    """Output that decode() drops or that never reached the client (K2), recorded explicitly.

    ``index`` is the output token index (-1 when not tied to one token); ``reason`` is one of
    ``special_token_skipped``, ``unknown_token_id``, ``leading_space_cleanup``,
    ``pending_discarded`` (G2), ``invalid_residue`` (K3) or ``incomplete_tail`` (a partial
    last character a budget or a stop id sequence cut, :meth:`IncrementalDetokenizer.finish_cut`).
    """

    index: int
    token_id: int
    reason: str
    data: bytes


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


_PROFILES: dict[int, TokenizerProfile] = {}


def profile_of(tokenizer: tokenizers.Tokenizer) -> TokenizerProfile:
    """The cached profile of a tokenizer (the profile keeps it alive, so its id stays unique)."""
    found = _PROFILES.get(id(tokenizer))
    if found is None or found.tokenizer is not tokenizer:
        found = _PROFILES[id(tokenizer)] = TokenizerProfile(tokenizer)
    return found


def _held_utf8(data: bytes) -> int:
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


class IncrementalDetokenizer:
    """Turns selected token ids into exactly the new UTF-8 bytes (K1-K4)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = tokenizer
        self._profile = profile_of(tokenizer)
        self._mode = self._profile.mode
        self._views = self._profile.views[skip_special_tokens]
        self._skip = skip_special_tokens
        self.removed_spans: list[RemovedSpan] = []
        self._count = 0  # output tokens pushed
        self._closed = False
        # K1: window (token history suffix) and its decoded text; emitted_chars of it are out.
        prompt = list(prompt_token_ids)
        self._pending, self._tail_index = b"", 0
        upto = len(prompt) - _MIN_CONTEXT
        while True:
            start = self._clean_start(prompt, max(0, upto))
            self._window = prompt[start:]
            self._text = self._decode(self._window)
            self._analyse_tail()  # NOTE: sets the pending run and its start (_tail_index)
            # NOTE: a held prompt tail must follow rendered context, as in the full decode.
            if start == 0 or self._has_context(self._tail_index):
                break
            upto = start - 1
        # NOTE: the whole prompt text is context, never output, even a held byte run (K2, K4).
        self._emitted = len(self._text)
        # The prompt's own rendering while the output may still change it (see _rebase).
        self._boundary: str | None = self._text
        self._base = len(self._text)  # NOTE: chars of the window text that are prompt, not output
        self._any_rendered = self._has_context(len(self._window))
        self._output_rendered = False  # NOTE: has an output token rendered anything yet?
        self._held_tokens = 0

    # ---- public API -------------------------------------------------------------------------
    @property
    def pending(self) -> bytes:
        """Undecoded bytes held back (K1): an incomplete character or an open byte-token run."""
        return self._pending

    @property
    def held_tokens(self) -> int:
        """How many of the last pushed output tokens own bytes of :attr:`pending` (K2: their
        last byte is not out yet; the earlier ones' all are)."""
        return self._held_tokens

    def push(self, token_id: int) -> bytes:
        """Add one selected id; return the new bytes that are now final (whole characters, K3)."""
        if self._closed:
            raise RuntimeError("push() after finish()/discard_pending()")
        if self._views[token_id] is None or not self._any_rendered:
            self._note(token_id)
        if self._views[token_id] is not None:
            self._output_rendered = True
        self._count += 1
        self._window.append(token_id)
        text = self._text = self._tok.decode(self._window, skip_special_tokens=self._skip)
        stable = len(text) - self._analyse_tail()
        # NOTE: before a window cut, which leaves _tail_index stale
        self._held_tokens = (min(len(self._window) - self._tail_index, self._count)
                             if self._pending else 0)
        if self._boundary is not None:
            self._rebase(text)
        out = ""
        if stable > self._emitted:
            out = text[self._emitted : stable]
            self._emitted = stable
        if len(self._window) > _MAX_WINDOW:
            self._cut_window()
        return out.encode()

    def finish(self) -> bytes:
        """Drain the held tail at a normal end (G2); DecodingError if it is not valid text (K3)."""
        self._closed = True
        tail, pending = self._text[self._emitted :], self._pending
        if not self._output_rendered:
            pending = b""  # NOTE: a residue of the prompt alone is context, not output (K3)
        self._emitted = len(self._text)
        self._pending = b""
        self._held_tokens = 0
        invalid = self._mode is ByteMode.BYTE_LEVEL and bool(pending)
        if pending and not invalid:
            # NOTE: a byte-fallback run is final only if it is valid UTF-8 on its own.
            try:
                pending.decode("utf-8")
            except UnicodeDecodeError:
                invalid = True
        if invalid:
            self.removed_spans.append(RemovedSpan(-1, -1, "invalid_residue", pending))
            raise DecodingError(f"incomplete UTF-8 at end of output: {pending.hex()}")
        return tail.encode()

    def finish_cut(self) -> tuple[bytes, bytes]:
        """Drain the held tail where something other than the model cut the output: a budget
        (``utf8_tail: auto``, K3) or a stop id sequence that follows these tokens (S1).
        Returns ``(text, cut)``: the final bytes, and the trailing incomplete character that
        the cut left (a proper prefix of a valid character, removed: K2 span
        ``incomplete_tail``). A residue that no byte could complete still raises
        DecodingError (K3)."""
        pending = self._pending if self._output_rendered else b""
        try:
            return self.finish(), b""
        except DecodingError:
            pass
        # NOTE: a byte-level residue is one partial character; a byte-fallback run is whole
        # characters then at most one partial one (an earlier error would have emitted it)
        held = _held_utf8(pending)
        keep = pending[: len(pending) - held]
        try:
            keep.decode("utf-8")
        except UnicodeDecodeError:
            held = 0
        if not held or (self._mode is ByteMode.BYTE_LEVEL and keep):
            raise DecodingError(f"incomplete UTF-8 at end of output: {pending.hex()}")
        self.removed_spans[-1] = RemovedSpan(-1, -1, "incomplete_tail", pending[len(keep):])
        return keep, pending[len(keep):]

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy of this state (the output processor keeps one before each id
        that may begin a stop id sequence, to drain the text before the sequence, S1)."""
        twin = copy.copy(self)
        twin._window = list(self._window)
        twin.removed_spans = list(self.removed_spans)
        return twin

    def discard_pending(self) -> bytes:
        """After a stop hit (G2): drop the held tail without finish(); return what was dropped."""
        self._closed = True
        dropped = self._pending
        self._emitted = len(self._text)
        self._pending = b""
        self._held_tokens = 0
        if dropped:
            self.removed_spans.append(RemovedSpan(-1, -1, "pending_discarded", dropped))
        return dropped

    def snapshot(self) -> dict[str, object]:
        """K1 state for the trace: history suffix length, pending bytes (hex), cleanup state."""
        return {
            "history_suffix_len": len(self._window),
            "pending_hex": self._pending.hex(),
            "cleanup_state": {
                "byte_mode": self._mode.value,
                "window_chars": len(self._text),
                "emitted_chars": self._emitted,
                "skip_special_tokens": self._skip,
                "any_rendered": self._any_rendered,
                "closed": self._closed,
            },
        }

    # ---- internals --------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def _rebase(self, text: str) -> None:
        """Prompt/output boundary (K2, K4; docs/output-text.md).

        Output is the decode of prompt + output after the longest common prefix with the
        decode of the prompt alone. Only the first output tokens can re-render the prompt's
        end: one that completes a character the prompt ended inside, one that extends the
        prompt's byte-fallback run (decoded as one group), or a cleanup rule spanning the
        boundary. Those characters are then output again, whole; nothing else of the prompt is.
        """
        ctx = self._boundary
        assert ctx is not None
        base = len(ctx)
        if not text.startswith(ctx):
            base = 0
            for a, b in zip(ctx, text, strict=False):
                if a != b:
                    break
                base += 1
        # NOTE: emitted = base + output chars sent; a transient re-render moves only the base.
        self._emitted += base - self._base
        self._base = base
        if not self._pending:
            self._boundary = None  # NOTE: no open run or partial character: the prompt is fixed

    def _has_context(self, end: int) -> bool:
        return any(self._views[t] is not None for t in self._window[:end])

    def _note(self, token_id: int) -> None:
        """Record what decode() drops around this id (K2): skipped specials, first-token space."""
        token = self._tok.id_to_token(token_id)
        if token is None:
            self.removed_spans.append(RemovedSpan(self._count, token_id, "unknown_token_id", b""))
        elif self._views[token_id] is None:
            span = RemovedSpan(self._count, token_id, "special_token_skipped", token.encode())
            self.removed_spans.append(span)
        else:
            self._any_rendered = True
            if self._profile.strips_leading_space and token.startswith("▁"):
                # NOTE: informational: decode() itself drops this space (K4), so K2 still holds.
                span = RemovedSpan(self._count, token_id, "leading_space_cleanup", b" ")
                self.removed_spans.append(span)

    def _analyse_tail(self) -> int:
        """Set pending bytes and tail start from byte views; return unstable trailing chars."""
        window, views = self._window, self._views
        self._pending, self._tail_index = b"", len(window)
        mode = self._mode
        if mode is ByteMode.TEXT:
            return 0
        last = views[window[-1]] if window else None
        if mode is ByteMode.BYTE_LEVEL:
            if isinstance(last, bytes) and last and last[-1] < 0x80:
                return 0  # NOTE: fast path: ends in ASCII, nothing can be incomplete
            data, i = b"", len(window)
            while i > 0 and len(data) < 3:
                i -= 1
                v = views[window[i]]
                if isinstance(v, bytes):
                    data = v + data
            held = _held_utf8(data)
            if held:
                self._pending, self._tail_index = data[-held:], self._byte_owner(held)
            return 1 if held else 0  # NOTE: lossy decode shows an incomplete tail as one U+FFFD
        if last == -1:
            return 0  # NOTE: fast path: a text token closes any byte run
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
            return 0
        raw = bytes(reversed(run))
        try:
            chars = len(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            if err.reason != "unexpected end of data":
                return 0  # NOTE: already invalid: every byte is a final U+FFFD, emit them
            chars = len(raw)  # NOTE: an incomplete run renders as one U+FFFD per byte
        self._pending, self._tail_index = raw, i
        # NOTE: min: with nothing rendered before the run, first-token cleanup may shrink it.
        return min(chars, len(self._text))

    def _byte_owner(self, held: int) -> int:
        """BYTE_LEVEL: window index of the token holding the first of the last ``held`` bytes."""
        i = len(self._window)
        while held > 0:
            i -= 1
            v = self._views[self._window[i]]
            if isinstance(v, bytes):
                held -= len(v)
        return i

    def _clean_start(self, ids: list[int], upto: int) -> int:
        """Largest q <= upto where decoding ids[q:] cannot change the text after ids[q]."""
        views = self._views
        for q in range(min(upto, len(ids) - 1), -1, -1):
            v = views[ids[q]]
            if v is None:
                continue
            if isinstance(v, bytes):
                if v and not 0x80 <= v[0] < 0xC0:
                    return q  # NOTE: a lead or ASCII byte restarts UTF-8 decoding
            elif v >= 0:
                prev = next((views[t] for t in reversed(ids[:q]) if views[t] is not None), -1)
                if prev == -1:
                    return q  # NOTE: start of a byte run: the run is not split
            else:
                return q
        return 0

    def _cut_window(self) -> None:
        """Drop old context: keep >= _MIN_CONTEXT rendered ids before the tail (verified)."""
        if self._boundary is not None:
            return  # NOTE: the prompt's rendering is still open; its text is the reference
        window = self._window
        rendered = [i for i in range(self._tail_index) if self._views[window[i]] is not None]
        if len(rendered) <= _MIN_CONTEXT:
            return
        q = self._clean_start(window, rendered[-_MIN_CONTEXT])
        if q == 0:
            return
        unemitted = self._text[self._emitted :]
        text = self._decode(window[q:])
        if len(text) < len(unemitted) or not text.endswith(unemitted):
            return  # NOTE: cutting here would change the held text: keep the longer window
        self._window = window[q:]
        self._text = text
        self._emitted = len(text) - len(unemitted)
