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
turn the whole run into U+FFFD; a run that is already invalid is emitted at once.

Its parts: :mod:`coda.detokenizer_profile` (a tokenizer's byte mode and byte views, cached per
tokenizer by :func:`profile_of`: do not mutate a tokenizer after its first detokenizer) and
:mod:`coda.detokenizer_held` (the held tail read from the byte views, and what a cut leaves).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import tokenizers

from coda.detokenizer_held import byte_level_tail, byte_run_tail, cut_residue
from coda.detokenizer_profile import ByteMode, TokenizerProfile
from coda.errors import DecodingError

_MAX_WINDOW = 6  # NOTE: window length that triggers a cut back to a clean boundary
_MIN_CONTEXT = 1  # NOTE: rendered tokens kept before the unstable tail after a cut


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


# NOTE: the profiles' cache lives with the detokenizer, which looks its profile up per request
# (a plain request runs no function of coda.detokenizer_profile: its profile is built once)
_PROFILES: dict[int, TokenizerProfile] = {}


def profile_of(tokenizer: tokenizers.Tokenizer) -> TokenizerProfile:
    """The cached profile of a tokenizer (the profile keeps it alive, so its id stays unique)."""
    found = _PROFILES.get(id(tokenizer))
    if found is None or found.tokenizer is not tokenizer:
        found = _PROFILES[id(tokenizer)] = TokenizerProfile(tokenizer)
    return found


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
        keep = cut_residue(pending, self._mode is ByteMode.BYTE_LEVEL)
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
            self._pending, self._tail_index = byte_level_tail(window, views)
            # NOTE: lossy decode shows an incomplete tail as one U+FFFD
            return 1 if self._pending else 0
        if last == -1:
            return 0  # NOTE: fast path: a text token closes any byte run
        self._pending, self._tail_index, chars = byte_run_tail(window, views)
        # NOTE: min: with nothing rendered before the run, first-token cleanup may shrink it.
        return min(chars, len(self._text))

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
