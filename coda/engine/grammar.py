"""Constrained decoding: a grammar turned into a per-step token mask (SPEC S1, G1, L4; issue 5).

Why llguidance and not xgrammar: both compile JSON schemas, regexes and grammars into token
masks in native code, but xgrammar's wheel depends on triton (about 1 GB) unless installed with
``--no-deps``, while llguidance is a small self-contained Rust extension (numpy only) that also
accepts Lark grammars and regexes directly. We never import ``llguidance.torch``: its helper is
wrapped in ``torch.compile`` and costs seconds on first call; the mask is unpacked with numpy.

Contract (what the engine relies on):

- :func:`compile_grammar` runs at submit time, on the submitting thread. An invalid schema,
  regex or grammar raises :class:`~coda.errors.InvalidRequestError` (``field="response_format"``)
  before anything is queued. The llguidance tokenizer it needs is built once per tokenizer and
  prepared off the request path (:mod:`coda.engine.grammar_tokenizer`: its cache, its
  warm-up thread and when that thread builds).
- :class:`GrammarMatcher` is then used on the engine thread only, once per step:
  ``allowed_mask()`` before choosing (bool ``[vocab_size]``, True = allowed), ``consume(id)``
  after the choice, and ``is_terminated()`` from the per-token checks (G1: grammar termination
  comes after max tokens and context limit) — True ends the request ``grammar_complete`` (L4).
- EOS: llguidance allows the EOS ids exactly when the grammar accepts. When the grammar accepts
  and cannot continue, the matcher is *stopped*: ``is_terminated()`` is True (so the request
  ends ``grammar_complete`` without spending a step on EOS) and the mask, if asked, allows only
  EOS. When it accepts but could continue, EOS is one of the allowed tokens; the model choosing
  it ends the request ``eos``.
- Speculation (issue 21, :mod:`coda.engine.speculative`) never consumes a drafted token:
  ``valid_prefix(ids)`` says how many drafts the grammar allows in order (state unchanged),
  and ``lookahead()`` advances the matcher through drafted tokens to give the masks of the
  rows after them, rolling exactly those tokens back when closed (the cached mask, the
  consumed count and the error stay the request's own).
- Bounded (:mod:`coda.engine.grammar_guard`): every mask is computed with a time bound, since
  llguidance can loop forever on some grammars. The first mask is computed at submit time: a
  grammar stuck there is an InvalidRequestError (400 naming the field). One stuck later (on the
  engine thread) marks the matcher :attr:`GrammarMatcher.stuck` (it is never touched again), so
  the request's next ``consume`` fails and the engine ends it ``model_error`` with the reason;
  the other requests go on.
- Ids at or above the tokenizer's size (a model vocabulary padded past the tokenizer) are never
  allowed.
- JSON (``json_schema``, ``json_object``) is compact by default (``whitespace_flexible: false``):
  free whitespace would let a weak model pad forever; a schema may opt back in with
  ``"x-guidance": {"whitespace_flexible": true}``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers
import torch

from coda.engine.grammar_guard import GrammarStuckError, bounded
from coda.engine.grammar_schema import schema_problem
from coda.engine.grammar_tokenizer import ll_tokenizer
from coda.engine.types import GrammarSpec
from coda.errors import InvalidRequestError

if TYPE_CHECKING:  # NOTE: imported by the first grammar, not by the server's start (issue 19)
    import llguidance as llg

__all__ = ["GrammarMatcher", "Lookahead", "check_grammar", "compile_grammar", "grammar_source"]

log = logging.getLogger("coda.engine.grammar")

FIELD = "response_format"
# NOTE: compact JSON; applied as llguidance *defaults*, so a schema's x-guidance may override it.
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar text for ``spec`` (exactly one of its fields must be set)."""
    import llguidance as llg

    chosen = [name for name, on in (("json_schema", spec.json_schema is not None),
                                    ("json_object", spec.json_object),
                                    ("regex", spec.regex is not None),
                                    ("lark", spec.lark is not None)) if on]
    if len(chosen) != 1:
        raise InvalidRequestError(
            f"a grammar needs exactly one of json_schema, json_object, regex, lark; got {chosen}",
            field=FIELD)
    try:
        if spec.json_schema is not None:
            if not isinstance(spec.json_schema, dict):
                raise InvalidRequestError("json_schema must be a JSON object", field=FIELD)
            problem = schema_problem(spec.json_schema)
            if problem:
                raise InvalidRequestError(f"{FIELD}: invalid grammar: {problem}", field=FIELD)
            return llg.LLMatcher.grammar_from_json_schema(json.dumps(spec.json_schema),
                                                          defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
        if spec.json_object:
            return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                          defaults=_JSON_DEFAULTS)  # type: ignore[arg-type]
        if spec.regex is not None:
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        assert spec.lark is not None
        return llg.LLMatcher.grammar_from_lark(spec.lark)
    except (TypeError, ValueError) as exc:  # NOTE: not JSON-serialisable / not an object
        raise InvalidRequestError(f"{FIELD}: invalid {chosen[0]}: {exc}", field=FIELD) from exc


def check_grammar(spec: GrammarSpec) -> None:
    """Raise the InvalidRequestError :func:`compile_grammar` would for ``spec``, without a
    tokenizer: for a request that is checked but never submitted (``/v1/responses/input_tokens``
    takes the create's 400s)."""
    import llguidance as llg

    error = llg.LLMatcher.validate_grammar(grammar_source(spec))
    if error:
        raise InvalidRequestError(f"{FIELD}: invalid grammar: {error.strip()}", field=FIELD)


def compile_grammar(spec: GrammarSpec, tokenizer: tokenizers.Tokenizer, vocab_size: int,
                    eos_token_ids: frozenset[int]) -> GrammarMatcher:
    """Compile ``spec`` for this tokenizer and model vocabulary; raises InvalidRequestError
    (``field="response_format"``) when the schema, regex or grammar is invalid."""
    import llguidance as llg

    tok = ll_tokenizer(tokenizer, eos_token_ids)
    matcher = llg.LLMatcher(tok, grammar_source(spec), log_level=0)
    if matcher.is_error():
        # NOTE: the message names its field itself: the engine's words (an unknown "format")
        # can hold the wire's name of it (Ollama's ``format``), which then went unnamed
        raise InvalidRequestError(f"{FIELD}: invalid grammar: {matcher.get_error().strip()}",
                                  field=FIELD)
    for warning in matcher.get_grammar_warnings():
        log.warning("grammar warning: %s", warning)
    trigger = spec.trigger.encode() if spec.trigger else None
    grammar = GrammarMatcher(matcher, tok.vocab_size, vocab_size, tok, trigger)
    try:
        grammar.prime()
    except GrammarStuckError as exc:
        raise InvalidRequestError(f"{FIELD}: {exc}", field=FIELD) from None
    return grammar


class GrammarMatcher:
    """The state of one request's grammar; engine thread only (see the module contract)."""

    def __init__(self, matcher: llg.LLMatcher, tokenizer_size: int, vocab_size: int,
                 ll_tokenizer: llg.LLTokenizer | None = None,
                 trigger: bytes | None = None) -> None:
        self._m = matcher
        self.trigger = trigger          # NOTE: GrammarSpec.trigger, for the closure walk
        self.matcher = matcher          # NOTE: the closure walk (coda.engine.closure) reads it
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        # NOTE: ids the tokenizer cannot produce (>= tokenizer_size) stay False in every mask
        self._n_real = min(tokenizer_size, vocab_size)
        self._words = np.zeros((tokenizer_size + 31) // 32, dtype=np.int32)
        self._mask: torch.Tensor | None = None  # cached until the next consume
        self.num_consumed = 0
        self.error: str | None = None
        # NOTE: a mask call that did not return in time still holds ``_m``: never touch it again
        self.stuck = False

    # -- per step --------------------------------------------------------------------------
    def allowed_mask(self) -> torch.Tensor | None:
        """Bool ``[vocab_size]`` of the tokens the grammar allows next (a fresh tensor; the
        caller may keep it). Computed once per state: repeated calls before ``consume`` reuse it."""
        if self._mask is None:
            self._mask = self._compute_mask()
        return self._mask.clone()

    def prime(self) -> None:
        """Compute (and cache) the first mask; raises GrammarStuckError if it is stuck."""
        self._mask = self._mask_now()

    def _compute_mask(self) -> torch.Tensor:
        """The mask of the matcher's state now (uncached). One that does not finish in time
        marks the matcher stuck (with :attr:`error`) and allows every token: the request's
        next ``consume`` fails."""
        if not self.stuck:
            try:
                return self._mask_now()
            except GrammarStuckError as exc:
                self.stuck, self.error = True, str(exc)
        return torch.ones(self.vocab_size, dtype=torch.bool)

    def _mask_now(self) -> torch.Tensor:
        words = self._words
        # NOTE: fills one bit per tokenizer id, little-endian within each int32 word
        ptr, size, m = words.ctypes.data, words.nbytes, self._m
        bounded(lambda: m.unsafe_compute_mask_ptr(ptr, size), "a token mask")
        bits = np.unpackbits(words.view(np.uint8), count=self._n_real, bitorder="little")
        allowed = np.zeros(self.vocab_size, dtype=np.bool_)
        allowed[: self._n_real] = bits.view(np.bool_)
        return torch.from_numpy(allowed)

    def consume(self, token_id: int) -> bool:
        """Advance past the chosen token. Never raises (it runs inside the engine step):
        a token the grammar rejects — impossible when its mask was applied — puts the matcher in
        an error state, logged and kept in :attr:`error`; it then reports terminated."""
        self._mask = None
        self.num_consumed += 1
        if self.stuck:
            return False
        ok = (0 <= token_id < self._n_real) and self._m.consume_token(token_id)
        if not ok and self.error is None:
            self.error = self._m.get_error() or f"token {token_id} is outside the grammar"
            log.error("grammar rejected token %d after %d tokens: %s", token_id,
                      self.num_consumed - 1, self.error)
        return bool(ok)

    # -- speculation (issue 21): drafted tokens, never consumed ----------------------------
    def valid_prefix(self, token_ids: Seq[int]) -> int:
        """How many of ``token_ids``, in order, the grammar allows from its state now (the
        state is unchanged): a drafted token past them can never be a pick."""
        if self.stuck:
            return 0
        n = 0
        while n < len(token_ids) and 0 <= token_ids[n] < self._n_real:
            n += 1
        return int(self._m.validate_tokens(list(token_ids[:n]))) if n else 0

    def lookahead(self) -> Lookahead:
        """A tentative advance through drafted tokens, rolled back when it closes
        (:class:`Lookahead`)."""
        return Lookahead(self)

    def is_terminated(self) -> bool:
        """True when the output is complete and nothing but EOS may follow (or on error)."""
        return self.error is not None or self._m.is_stopped()

    def is_accepting(self) -> bool:
        """True when the output so far is a complete sentence of the grammar."""
        return self.error is None and self._m.is_accepting()

    @property
    def is_closed(self) -> bool:
        """Closure for the early-stop ``require_closure`` rule (D1): the grammar accepts."""
        return self.is_accepting()


class Lookahead:
    """Issue 21: the grammar advanced through drafted tokens and rolled back after, so that the
    verification row after ``d_0 .. d_{j-1}`` gets the mask plain decoding would compute once
    those tokens were chosen. Use as a context manager: :meth:`close` rolls the matcher back
    to where it was (the matcher's cached mask, its consumed count and error stay untouched:
    only what was pushed here is undone, exactly)."""

    def __init__(self, grammar: GrammarMatcher) -> None:
        self._g = grammar
        self.pushed = 0

    def push(self, token_id: int) -> bool:
        """Advance past ``token_id``; False (nothing consumed) where the grammar forbids it."""
        g = self._g
        if g.stuck or not 0 <= token_id < g._n_real or g._m.try_consume_tokens([token_id]) != 1:
            return False
        self.pushed += 1
        return True

    def mask(self) -> torch.Tensor:
        """The allowed tokens after what was pushed (a fresh tensor, as ``allowed_mask``)."""
        return self._g._compute_mask()

    def close(self) -> None:
        if self._g.stuck:  # NOTE: the abandoned call still holds the matcher
            self.pushed = 0
        if self.pushed:
            # NOTE: exactly what was pushed: rolling back one more puts llguidance in error
            self._g._m.rollback(self.pushed)
            self.pushed = 0

    def __enter__(self) -> Lookahead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
