"""Structured output that closes within the budget (issue 13 item 2; SPEC L4, L5, G1, S1).

A grammar-constrained request may run out of ``max_tokens`` (or context) in the middle of its
structure — a JSON number, an unterminated string — and return invalid output. With closure
on (the default for ``json_schema`` and tools), the engine keeps this invariant at every step::

    tokens needed to reach an accepting state  <=  tokens the request may still select

and, the moment a freely sampled token would break it, steers the rest of the output along a
short completion, ending the request ``grammar_forced_close`` (a natural end on the wire:
OpenAI ``stop``, Anthropic ``end_turn``; the exact reason in ``coda``).

How "tokens needed" is bounded: :func:`closing_path` walks from the current grammar state to an
accepting one byte by byte, at each step taking the first byte the grammar allows from a
fixed preference order (closing quotes and brackets first, then ``0``, then letters, then
everything else; forced bytes first of all). The walk is a *greedy* completion, not
necessarily the shortest, so its length is an upper bound on what is needed — which is the
direction the invariant needs. The byte path is then tokenized canonically and re-checked
against the grammar; if the grammar rejects that tokenization, the single-byte tokens are
used. The walk only takes bytes the tokenizer spells as one token, so every completion it finds
is realizable and the bound holds for any tokenizer. A tokenizer that spells every byte
(byte-level BPE, byte fallback) can always be walked; one that lacks some bytes (SmolLM2's GGUF
vocabulary has no token for six control bytes, 0xC0, 0xC1, 0xF1, 0xF2) is walked around them —
JSON never needs raw control bytes, and 0xC0/0xC1 never occur in UTF-8. A byte the grammar
lets repeat without end (`^[0-9]+x$` takes `0` forever, an email's local part too) would keep
the greedy walk in a loop: once it has chosen the same byte ``STALL_RUN`` times in a row (a
closing bracket outside text does not count: each one closes a level of nesting), the
run is cut back to one and from then on the walk prefers the bytes it has chosen least (the
fixed order among equals), which leaves every such loop, until it takes a quote (in JSON the
string that looped is closed: the plain order closes the rest, as short as before). Only when no
completion is found from the start (a grammar that needs a byte the tokenizer cannot spell) is
closure off for the request: it then behaves as before and may end ``max_output_tokens``.

Optional parts (tools ``auto``; ``GrammarSpec.trigger``, the opening tag): free text accepts at
every byte, text ending in ``<tool_c`` included, so the walk alone would count an empty
completion there and let the tag start when the call can no longer fit (the request then ended
with the half tag as text). Free text (the output accepts) that ends with the trigger's first
``k`` bytes (``0 < k < len``), where writing the rest of it would leave free text (the grammar stops
accepting: the call must follow), counts as the call *begun*: its completion is the rest of the
trigger, then the walk (``closing_path(..., lead=rest)``). So a token that starts or continues
the tag is admitted only where the tag plus the shortest call fits in the tokens left after it;
a rejected tag start in complete text ends the output there (:meth:`BudgetCloser.end_now`),
and forcing from a begun tag finishes the call. Which ``k`` to try comes from the chosen
token's bytes (a cheap filter; the grammar decides): only a token that may be in the tag costs
a walk. A forced path ends the request only once it is all chosen (its lead crosses accepting
text).

Admission: when even the initial closing path is longer than the budget, ``submit`` raises
:class:`~coda.errors.InvalidRequestError` naming ``max_tokens`` (a 400), before anything runs.

Cost: one greedy walk per sampled token (a few ``try_consume_tokens`` per byte of the
completion, then a rollback): about 0.3–0.5 ms for a 30-byte completion on the default model.
A rejected token is replaced by resampling the same step (same counter uniform) under a mask
that allows only the closing path's next token, so the draw stays a pure function of (seed,
step) and the decision record is the real one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from coda.engine.grammar import GrammarMatcher
from coda.finish import FinishReason

if TYPE_CHECKING:  # NOTE: llguidance is imported by the first grammar (issue 19 item 2)
    import llguidance as llg

__all__ = ["BudgetCloser", "ByteTable", "ClosingPath", "byte_table", "closing_path"]

# NOTE: preference order of the greedy walk: end what is open, then the smallest values. Inside
# free text (a letter is allowed) a quote comes first: there a bracket would be text, not a close.
# A separator comes before digits: after a number, more digits never bring the end closer.
_STRUCT = b"}]" + b'"' + b",:" + b"0123456789" + b"a" + b"etnrsilofdu" + b"-." + b" {["
_IN_TEXT = b'"' + _STRUCT
# NOTE: then every other byte: a prefix may end inside a UTF-8 character (continuation bytes)
_REST = bytes(range(32, 127)) + bytes(range(0x80, 0xF5)) + bytes(range(32))
_ORDER = list(dict.fromkeys(_STRUCT + _REST))
_ORDER_TEXT = list(dict.fromkeys(_IN_TEXT + _REST))
_PROBE = ord("a")
_QUOTE = ord('"')  # NOTE: in JSON a raw quote byte always opens or closes a string
_CLOSERS = b"]}"  # NOTE: outside text each one closes a level: a run of them is progress
MAX_WALK = 4096  # bytes; a completion longer than this counts as "not closable"
STALL_RUN = 8    # the same byte chosen this many times in a row: a loop the walk must leave


@dataclass(frozen=True)
class ByteTable:
    """Which token spells each single byte (None where no token does)."""

    ids: tuple[int | None, ...]

    @property
    def complete(self) -> bool:
        """Every byte that UTF-8 text can contain (0x00–0xF4) has a token, so the walk is never
        restricted (informative; the bound holds either way, module doc). NOTE: llguidance
        reserves 0xFF as its special-token marker."""
        return all(i is not None for i in self.ids[:0xF5])


_lock = threading.Lock()
# NOTE: keyed by id with the tokenizer kept alive (LLTokenizer takes no weak references); the
# engine's LLTokenizers are themselves cached per tokenizer, so this stays a handful of entries
_tables: dict[int, tuple[llg.LLTokenizer, ByteTable]] = {}


def byte_table(tok: llg.LLTokenizer) -> ByteTable:
    """The single-byte tokens of ``tok`` (cached per tokenizer)."""
    with _lock:
        entry = _tables.get(id(tok))
        cached = entry[1] if entry is not None and entry[0] is tok else None
        if cached is None:
            ids: list[int | None] = [None] * 256
            for b in range(256):
                toks = tok.tokenize_bytes(bytes([b]))
                if len(toks) == 1 and tok.decode_bytes(toks) == bytes([b]) and \
                        not tok.is_special_token(toks[0]):
                    ids[b] = toks[0]
            cached = ByteTable(tuple(ids))
            _tables[id(tok)] = (tok, cached)
        return cached


@dataclass(frozen=True)
class ClosingPath:
    """A completion from the current state to an accepting one, as tokens."""

    tokens: tuple[int, ...]
    text: bytes

    def __len__(self) -> int:
        return len(self.tokens)


def closing_path(m: llg.LLMatcher, tok: llg.LLTokenizer, table: ByteTable,
                 limit: int = MAX_WALK, lead: bytes = b"") -> ClosingPath | None:
    """A short completion of ``m``'s output (see the module doc), or None when none is found
    within ``limit`` steps (bytes taken, a cut-back run's included). ``lead``: bytes the completion must start with (the rest of a begun
    trigger), taken before the walk even where the output accepts. ``m`` is left in the state
    it was in."""
    if m.is_error():
        return None
    consumed: list[int] = []
    text = bytearray()
    used = [0] * 256     # NOTE: times each byte was chosen (not forced) in this walk
    run = 0              # how many times in a row the last byte was chosen
    looping = False      # a run reached STALL_RUN: prefer the least used bytes from now on
    try:
        for b in lead:
            tid = table.ids[b]
            if tid is None or m.try_consume_tokens([tid]) != 1:
                return None
            consumed.append(tid)
            text.append(b)
        steps = 0
        while not m.is_accepting():
            steps += 1  # NOTE: not len(text): a cut-back run must not walk for ever
            if steps > limit:
                return None
            forced = m.compute_ff_bytes()
            in_text = False
            if forced:
                candidates: list[int] = [forced[0]]
            else:
                probe = table.ids[_PROBE]
                in_text = probe is not None and m.validate_tokens([probe]) == 1
                candidates = _ORDER_TEXT if in_text else _ORDER
                if looping:  # NOTE: a stable sort: the preference order among equal counts
                    candidates = sorted(candidates, key=used.__getitem__)
            for b in candidates:
                tid = table.ids[b]
                if tid is not None and m.try_consume_tokens([tid]) == 1:
                    if not forced and (in_text or b not in _CLOSERS):
                        run = run + 1 if text and text[-1] == b else 1
                        used[b] += 1
                    consumed.append(tid)
                    text.append(b)
                    break
            else:
                return None
            if looping and b == _QUOTE:  # NOTE: the string that looped is closed: plain again
                looping, used = False, [0] * 256
            if run >= STALL_RUN:
                # NOTE: the byte may repeat forever (`^[0-9]+x$`, an email's local part): cut
                # the run back to one and leave it by the least used bytes (module doc)
                m.rollback(run - 1)
                del consumed[len(consumed) - run + 1:], text[len(text) - run + 1:]
                run, looping = 0, True
    finally:
        if consumed:
            m.rollback(len(consumed))
    raw = bytes(text)
    canonical = tok.tokenize_bytes(raw) if raw else []
    if canonical and len(canonical) < len(consumed) and m.validate_tokens(canonical) == len(
            canonical) and tok.decode_bytes(canonical) == raw:
        return ClosingPath(tuple(canonical), raw)
    return ClosingPath(tuple(consumed), raw)


class BudgetCloser:
    """One request's closure state (engine thread only; see the module doc).

    ``budget`` is the number of tokens the request may select in all (max_tokens, already
    capped by the context). Before the first token ``len(initial)`` <= budget is checked by the
    engine's admission; from then on :meth:`admits` keeps the invariant for each sampled token,
    and :meth:`force` switches to the closing path the moment a token would break it.
    """

    def __init__(self, grammar: GrammarMatcher, budget: int) -> None:
        assert grammar.ll_tokenizer is not None, "compile_grammar sets the llguidance tokenizer"
        self.grammar = grammar
        self.tok: llg.LLTokenizer = grammar.ll_tokenizer
        self.budget = budget
        self.table = byte_table(self.tok)
        self.trigger = grammar.trigger or b""  # NOTE: an optional part's opening (module doc)
        self.path: ClosingPath | None = None   # the forced completion, once forcing started
        self.forced_at = 0                     # tokens consumed when forcing started
        # NOTE: any tokenizer: the walk only uses bytes that have a token (module doc)
        self.closable = True

    def _left(self) -> int:
        return self.budget - self.grammar.num_consumed

    def initial(self) -> ClosingPath | None:
        """The closing path from the current state (admission: from the start)."""
        return self._completion(self.grammar.matcher, range(1, len(self.trigger)))

    def _completion(self, m: llg.LLMatcher, ends: Iterable[int]) -> ClosingPath | None:
        """The completion the invariant counts from ``m``'s state: through the rest of the
        trigger when the output ends inside it (a begun optional part), else the walk's."""
        for k in sorted(ends, reverse=True):  # NOTE: the longest begun prefix is the real one
            rest = self.trigger[k:]
            if self._enters(m, rest):
                return closing_path(m, self.tok, self.table, lead=rest)
        return closing_path(m, self.tok, self.table)

    def _enters(self, m: llg.LLMatcher, rest: bytes) -> bool:
        """Whether writing ``rest`` now completes the trigger, i.e. the output ends with its
        other bytes as free text: the grammar then no longer accepts (what the trigger opens
        must follow). ``m`` is left in the state it was in."""
        if not m.is_accepting():
            return False  # NOTE: inside what the trigger opened: the trigger is just bytes there
        n = 0
        try:
            for b in rest:
                tid = self.table.ids[b]
                if tid is None or m.try_consume_tokens([tid]) != 1:
                    return False
                n += 1
            return not m.is_accepting()
        finally:
            if n:
                m.rollback(n)

    def _ends(self, token_id: int) -> list[int]:
        """The lengths ``k`` for which the output after ``token_id`` may end with the trigger's
        first ``k`` bytes (0 < k < len): the token ends with them, or the token lies inside the
        trigger where they end. A cheap filter: :meth:`_enters` decides (from the grammar)."""
        t = self.trigger
        if not t:
            return []
        b = self.tok.decode_bytes([token_id])
        ends = {k for k in range(1, min(len(b), len(t) - 1) + 1) if b.endswith(t[:k])}
        ends |= {j + len(b) for j in range(1, len(t) - len(b))
                 if b and t[j:j + len(b)] == b}
        return sorted(ends)

    @property
    def forcing(self) -> bool:
        return self.path is not None

    def admits(self, token_id: int, eos_token_ids: frozenset[int], ahead: int = 0) -> bool:
        """Whether choosing ``token_id`` keeps a completion within the budget left after it.
        ``ahead``: drafted tokens the matcher was advanced through past the consumed ones
        (issue 21's verification, :class:`~coda.engine.grammar.Lookahead`)."""
        if self.path is not None or not self.closable or token_id in eos_token_ids:
            return True
        m = self.grammar.matcher
        if m.try_consume_tokens([token_id]) != 1:
            return True  # NOTE: the grammar's own check reports it (never happens under the mask)
        try:
            after = self._completion(m, self._ends(token_id))
        finally:
            m.rollback(1)
        return after is not None and len(after) <= self._left() - ahead - 1

    def force(self) -> ClosingPath | None:
        """Start forcing the closing path from the current state; None if none is found (the
        request then continues unforced)."""
        path = self.initial()
        if path is not None and path.tokens:
            self.path, self.forced_at = path, self.grammar.num_consumed
        return path

    def end_now(self, eos_token_ids: frozenset[int]) -> ClosingPath | None:
        """The output accepts now but the sampled token would open what cannot close within
        the budget (a second parallel call): force the end itself — the grammar's EOS — as a
        one-token closing path. None when the grammar allows no EOS here."""
        m = self.grammar.matcher
        for eos in sorted(eos_token_ids):
            if eos < self.grammar.vocab_size and m.validate_tokens([eos]) == 1:
                self.path = ClosingPath((eos,), b"")
                self.forced_at = self.grammar.num_consumed
                return self.path
        return None

    def mask(self, vocab_size: int) -> torch.Tensor | None:
        """While forcing: only the path's next token is allowed."""
        if self.path is None:
            return None
        pos = self.grammar.num_consumed - self.forced_at
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        if pos < len(self.path.tokens):
            mask[self.path.tokens[pos]] = True
        return mask

    def done(self) -> FinishReason | bool:
        """The grammar hook of the per-token checks (G1): a forced path that reached an
        accepting state ends ``grammar_forced_close``; otherwise the grammar's own end."""
        if self._closed():
            return FinishReason.GRAMMAR_FORCED_CLOSE
        return self.grammar.is_terminated()

    def _closed(self) -> bool:
        """The forced path is all chosen and the output accepts. NOTE: "accepts" alone is not
        enough: a path through a begun trigger crosses accepting free text before the tag is
        whole."""
        return (self.path is not None and self.grammar.is_accepting()
                and self.grammar.num_consumed - self.forced_at >= len(self.path.tokens))

    def budget_end(self) -> FinishReason | None:
        """At max tokens / context limit (G1: the budget's check, only its name may change):
        ``grammar_forced_close`` when the closing path was forced and reached an accepting
        state; ``grammar_complete`` when the output is complete on its own (the grammar is
        stopped: nothing but EOS may follow); otherwise None, and the budget names the end
        (L4). NOTE: "accepting" alone is not enough: free text under a tool grammar
        (``auto``) accepts at every byte, so it renamed every budget end (issue 20 D1)."""
        if self._closed():
            return FinishReason.GRAMMAR_FORCED_CLOSE
        if self.grammar.error is None and self.grammar.is_terminated():
            return FinishReason.GRAMMAR_COMPLETE
        return None
