"""Structured output that closes within the budget (issue 13 item 2; SPEC L4, L5, G1, S1).

A grammar-constrained request may run out of ``max_tokens`` (or context) in the middle of its
structure — a JSON number, an unterminated string — and return invalid output. With closure
on (the default for ``json_schema`` and tools), the engine keeps this invariant at every step::

    tokens needed to reach an accepting state  <=  tokens the request may still select

and, the moment a freely sampled token would break it, steers the rest of the output along a
short completion, ending the request ``grammar_forced_close`` (a natural end on the wire:
OpenAI ``stop``, Anthropic ``end_turn``; the exact reason in ``coda``).

How "tokens needed" is bounded: the greedy walk of :mod:`coda.engine.closure_walk`
(:func:`~coda.engine.closure_walk.closing_path`), an upper bound on what is needed — the
direction the invariant needs. Only when no completion is found from the start (a grammar that
needs a byte the tokenizer cannot spell) is closure off for the request: it then behaves as
before and may end ``max_output_tokens``.

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

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from coda.engine.closure_walk import ClosingPath, byte_table, closing_path
from coda.engine.grammar import GrammarMatcher
from coda.finish import FinishReason

if TYPE_CHECKING:  # NOTE: llguidance is imported by the first grammar (issue 19 item 2)
    import llguidance as llg

__all__ = ["BudgetCloser"]


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
        if self.grammar.stuck:
            return None
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
        if (self.path is not None or not self.closable or token_id in eos_token_ids
                or self.grammar.stuck):  # NOTE: a stuck matcher is never touched again
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
        if self.grammar.stuck:
            return None
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
