"""The processor's reasoning split: tokens while a ``<think>`` block may open or is open
(issue 23; SPEC G1, K2, L6, S1, S2; :mod:`coda.reasoning` holds the splitter itself).

While the output may open or is inside the block, each token's bytes go to the splitter
instead of the stop matchers (:func:`takes`, then :func:`push`): reasoning bytes are sent at
once as reasoning deltas (no stop sees them; a possible closer prefix waits), the markers are
removed (recorded on the terminal and as ``reasoning.split`` rows; L6: never sent, counted as
reached), and bytes after the closer start the answer, whose stream offsets (and the string and
id matchers') count from there (``_answer_base``, ``_id_base``). A reasoning budget makes
:func:`forced_token` name the closer id the engine must choose, one per step
(:func:`forced_tokens`: all of them, for drafts).

Functions of :class:`coda.output.OutputProcessor`'s state, called by it only when the request
has a splitter: a request without a reasoning split never runs this module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coda import trace as tr
from coda.reasoning import Phase, ReasoningSplitter

if TYPE_CHECKING:
    from coda.output import OutputProcessor


def takes(p: OutputProcessor, sp: ReasoningSplitter, token_id: int) -> bool:
    """True when the splitter takes this token's bytes (the block may open or is open),
    counting a token inside the block and a closer id the budget forced. The first token
    decides whether a block opens at all (an answer from its first byte otherwise)."""
    if sp.phase is Phase.OPENING and sp.spec.open_ids and token_id not in sp.spec.open_ids:
        sp.no_block()  # NOTE: the first token decides: an answer from its first byte
    if sp.phase is Phase.ANSWER:
        return False
    if sp.in_reasoning:
        if forced_token(p, sp) == token_id:
            p._forced += 1
        p.reasoning_tokens += 1
    return True


def forced_token(p: OutputProcessor, sp: ReasoningSplitter) -> int | None:
    """The closer id the reasoning budget forces at the next step, or None (the engine masks
    the step to it, like the grammar closure)."""
    if not sp.in_reasoning or sp.spec.budget_tokens is None:
        return None
    ids = sp.spec.close_ids
    if p._forced >= len(ids) or (not p._forced and p.reasoning_tokens < sp.spec.budget_tokens):
        return None
    return ids[p._forced]


def forced_tokens(p: OutputProcessor, sp: ReasoningSplitter) -> tuple[int, ...]:
    """Every closer id the reasoning budget still forces, in order, from :func:`forced_token`
    on (issue 21 drafts them); () when none is forced now."""
    if forced_token(p, sp) is None:
        return ()
    return sp.spec.close_ids[p._forced:]


def push(p: OutputProcessor, data: bytes, final: bool = False) -> bool:
    """Bytes of the output while the reasoning block may open or is open: the reasoning part
    is sent at once (no stop sees it; a possible closer prefix waits), the markers are
    removed, and answer bytes after the closer go on to the stop matcher like any answer.
    ``final``: the drain, which also finishes the splitter. True on a stop hit in those
    answer bytes."""
    sp = p.splitter
    assert sp is not None
    before = (len(sp.opener), len(sp.closer))
    reasoning, answer = sp.push(data)
    if final:
        more_r, more_a = sp.finish()
        reasoning, answer = reasoning + more_r, answer + more_a
    removed = len(sp.opener) + len(sp.closer) - sum(before)
    p._removed += removed
    p._advance_returned()
    if sp.phase is not Phase.ANSWER:
        if p._tracing and data:
            p._record(tr.STOP_STATE, nbytes=len(data), starts=p._starts, held=sp.held,
                      detok_pending=len(p.detok.pending), ids_held=0)
        if removed:
            p._record(tr.REASONING_SPLIT, removed=removed, part="opener")
        p._send(reasoning, reasoning=True)
        p._track_hold()
        return False
    # NOTE: the answer starts here: stream offsets (the matcher's too) count from it, and the
    # id matcher sees the tokens after this one
    p._answer_base = p.detok_bytes - len(answer)
    p._id_base = p.generated
    return p._emit(answer, 0, reasoning=reasoning, pre=len(data) - len(answer), removed=removed)
