"""What a speculating step verifies and how (issue 21; SPEC T1, T4, G1, L6, L7, O1): the drafts
cut to what can be accepted, a forced path drafted as itself, each row sampled as plain
decoding samples its position, and the accepted prefix (coda.engine.speculative's module
docstring: "Verification", "Acceptance", "Constrained requests").
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from coda.engine.grammar import GrammarMatcher
from coda.engine.sampler import SamplingRow, TokenDecision
from coda.engine.sequence import Sequence
from coda.output import OutputProcessor
from coda.reasoning import Phase

if TYPE_CHECKING:
    from coda.engine.closure import BudgetCloser
    from coda.engine.speculative_state import SpecState

_UNBOUNDED = 1 << 30


def forced_path(processor: OutputProcessor, closer: BudgetCloser | None
                ) -> tuple[tuple[int, ...], bool]:
    """The tokens the per-token loop forces from the next one on, in order, as
    ``EngineCore._row`` masks them (a reasoning budget's closer first), and whether the
    request ends with the last of them: a reasoning budget's closer ids still to choose (the
    answer follows), else the budget closer's path still to choose (the request ends
    ``grammar_forced_close`` with it); ``((), False)`` when nothing is forced."""
    rest = processor.forced_tokens()
    if rest:
        return rest, False
    if closer is not None and closer.path is not None:
        return closer.path.tokens[closer.grammar.num_consumed - closer.forced_at:], True
    return (), False


def live_forced(processor: OutputProcessor, closer: BudgetCloser | None) -> int | None:
    """The token the loop's next row is forced to (None: not forced; -1: a mask that allows
    nothing, a closing path chosen to its end)."""
    forced = processor.forced_token()
    if forced is not None:
        return forced
    if closer is None or closer.path is None:
        return None
    pos = closer.grammar.num_consumed - closer.forced_at
    return closer.path.tokens[pos] if pos < len(closer.path.tokens) else -1


def forced_drafts(spec: SpecState, seq: Sequence, tokens_left: int, processor: OutputProcessor,
                  closer: BudgetCloser | None) -> tuple[int, ...]:
    """The drafts of a request whose next tokens are forced (module docstring, "A forced path
    is its own draft"): the forced path, without its last token where that ends the request
    (the last row picks it), at most ``k_max`` and never past the budget; () when nothing is
    forced. Sets ``spec.forced`` (the rows :func:`row_mask` forces) for this step."""
    path, ends = forced_path(processor, closer)
    spec.forced = path
    if not path or seq.num_uncomputed_tokens != 1:
        return ()
    k = min(spec.config.k_max, tokens_left - 1, len(path) - ends)
    return path[:max(k, 0)]


def closer_after(spec: SpecState, drafts: tuple[int, ...], horizon: int,
                 processor: OutputProcessor, room: int) -> tuple[int, ...]:
    """``drafts`` (guesses, already cut to :func:`plain_horizon`), followed by the reasoning
    budget's closer ids where they reach it (module docstring, "A forced path is its own
    draft"): row ``horizon`` is the one where the closer is forced, so with every guess
    accepted the closer's ids are chosen in this same step, with plain decoding's one-token
    masks (:attr:`SpecState.forced`, set here). At most ``k_max`` of them and ``room`` drafts
    in all (the budget); ``drafts`` unchanged where they stop short of the horizon or no
    reasoning block with a budget is open. A guess that ends the block early (or is not
    counted) leaves the loop's state different from the rows' assumption at the first forced
    row: the engine checks it at every emitted row (:func:`live_forced`) and draws that row
    again from its own state, so the output never depends on this."""
    sp = processor.splitter
    if (not drafts or len(drafts) != horizon or sp is None or not sp.in_reasoning
            or sp.spec.budget_tokens is None):
        return drafts
    ids = sp.spec.close_ids[:max(0, min(spec.config.k_max, room - len(drafts)))]
    if not ids:
        return drafts
    spec.forced = (None,) * len(drafts) + ids
    return drafts + ids


def row_mask(forced: Seq[int | None], j: int, vocab_size: int) -> torch.Tensor | None:
    """Row ``j``'s mask where a forced path decides it (plain decoding's one-token mask), else
    None (the grammar's, or none)."""
    tok = forced[j] if j < len(forced) else None
    if tok is None:
        return None
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[tok] = True
    return mask


def plain_horizon(processor: OutputProcessor, closer: BudgetCloser | None) -> int:
    """How many drafts a request can verify now: rows ``1 .. h - 1`` are then sure to be
    chosen with the grammar's own mask (or none), as :func:`row_at` samples them, and row
    ``h`` is checked again when it is the pick (``core_spec.live_pick``). 0 while the
    budget closer forces its path or a reasoning budget forces its closer; inside (or
    before) a reasoning block with a budget, the tokens left of it: the closer is forced at
    the first row where the block holds ``budget_tokens`` tokens, and each row adds at most
    one (guesses that reach it are followed by the closer's ids: :func:`closer_after`)."""
    if (closer is not None and closer.forcing) or processor.forced_token() is not None:
        return 0
    sp = processor.splitter
    if sp is None or sp.phase is Phase.ANSWER or sp.spec.budget_tokens is None:
        return _UNBOUNDED
    return max(0, sp.spec.budget_tokens - processor.reasoning_tokens)


def row_at(base: SamplingRow, drafts: Seq[int], j: int,
           mask: torch.Tensor | None = None) -> SamplingRow:
    """Row ``j`` of a verification: what plain decoding samples at output position
    ``base.step + j`` once ``drafts[:j]`` were chosen (row 0 is ``base`` itself); ``mask``:
    the grammar's allowed tokens after ``drafts[:j]`` (None: unconstrained)."""
    if j == 0:
        return base
    return replace(base, step=base.step + j, allowed_token_ids_mask=mask,
                   output_token_ids=list(base.output_token_ids) + list(drafts[:j]))


def verify_rows(base: SamplingRow, drafts: Seq[int], forced: Seq[int | None] = (),
                vocab_size: int = 0) -> list[SamplingRow]:
    """Rows ``0..k`` of an unconstrained request's verification (:func:`row_at`); ``forced``:
    the forced path's rows (:func:`row_mask`; row 0's is ``base``'s own)."""
    return [row_at(base, drafts, j, row_mask(forced, j, vocab_size))
            for j in range(len(drafts) + 1)]


def verify_constrained(base: SamplingRow, first: TokenDecision, drafts: Seq[int],
                       grammar: GrammarMatcher,
                       sample: Callable[[int, SamplingRow], TokenDecision],
                       admits: Callable[[int, int], bool] | None = None,
                       forced: Seq[int | None] = (), vocab_size: int = 0,
                       ) -> tuple[list[TokenDecision], int]:
    """Sample-and-match under a grammar (module docstring, "Constrained requests").

    ``first`` is row 0's decision (``base``: the grammar's mask now). Draft ``d_j`` is
    accepted iff it equals row ``j``'s pick and ``admits(d_j, j)`` (the budget closer's check
    as plain decoding makes it there; None: no closer); only then is the grammar advanced
    past it and row ``j + 1`` sampled, ``sample(j + 1, row)``, with the mask after
    ``d_0 .. d_j`` (a forced row: plain decoding's one-token mask, :func:`row_mask`, the
    grammar advanced all the same). The grammar is rolled back after. Returns the decisions of rows
    ``0 .. a`` and ``a``, the accepted count: decision ``a`` is the pick after them."""
    decs = [first]
    with grammar.lookahead() as ahead:
        for j, d in enumerate(drafts):
            if decs[j].token_id != d or (admits is not None and not admits(d, j)) or \
                    not ahead.push(d):
                return decs, j
            mask = row_mask(forced, j + 1, vocab_size)
            decs.append(sample(j + 1, row_at(base, drafts, j + 1,
                                             ahead.mask() if mask is None else mask)))
    return decs, len(drafts)


def accepted_prefix(drafts: Seq[int], decisions: Seq[TokenDecision]) -> int:
    """How many drafted tokens equal the pick of their row (the sample-and-match rule)."""
    a = 0
    while a < len(drafts) and decisions[a].token_id == drafts[a]:
        a += 1
    return a

