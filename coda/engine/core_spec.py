"""EngineCore's speculative half (issue 21; SPEC T1, T4, G1, L6, L7, O1): the step's drafts in,
the verified tokens out, through the core's own per-token loop.

A plain step never enters this module (``EngineCore._drafts`` returns no drafts where no
request speculates; a chunk without drafts is chosen by ``EngineCore._choose`` alone). What the
drafts are and how their rows are sampled and accepted: :mod:`coda.engine.speculative` and
:mod:`coda.engine.speculative_verify`; a draft model's proposals: :mod:`coda.engine.draft`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from coda import trace as tr
from coda.engine.draft import DraftJob
from coda.engine.sampler import SamplingRow, TokenDecision
from coda.engine.sequence import SequenceStatus
from coda.engine.speculative_state import SpecState
from coda.engine.speculative_verify import (
    accepted_prefix,
    closer_after,
    forced_drafts,
    live_forced,
    plain_horizon,
    verify_constrained,
)
from coda.finish import FinishReason
from coda.lifecycle import State

if TYPE_CHECKING:
    from coda.engine.core import EngineCore
    from coda.engine.engine_request import EngineRequest

log = logging.getLogger("coda.engine")  # NOTE: the core's logger, as before the split


def step_drafts(core: EngineCore, paused: frozenset[int]) -> dict[int, tuple[int, ...]]:
    """Issue 21: each speculating decoder's drafted tokens (coda.engine.speculative; with
    a draft model, coda.engine.draft)."""
    rows = core.scheduler.num_running
    out: dict[int, tuple[int, ...]] = {}
    guess: list[tuple[EngineRequest, SpecState]] = []
    for sid, r in core.requests.items():
        if r.spec is None:
            continue
        # NOTE: a forced path is known: its own draft, every one accepted (no guess)
        left = r.processor.tokens_left  # NOTE: the processor's room: the one budget home
        if forced := forced_drafts(r.spec, r, left, r.processor, r.closer):
            out[sid] = forced
        elif not r.spec.forced:
            guess.append((r, r.spec))
    # NOTE: a chat prediction drafts itself, a draft model or not (coda.engine.prediction)
    own = [(r, spec) for r, spec in guess if core.drafter is None or spec.predicted]
    out.update((r.seq_id, d) for r, spec in own if (d := verifiable(
        r, spec.propose(r, r.processor.tokens_left, rows))))
    guess = [(r, spec) for r, spec in guess if core.drafter is not None and not spec.predicted]
    if core.drafter is None or not guess:
        return out
    jobs = [DraftJob(r, k, r.sampling_row(core._vocab), r.grammar) for r, spec in guess
            if r.seq_id not in paused
            and r.num_uncomputed_tokens == 1 and r.status is SequenceStatus.RUNNING
            and (k := min(r.processor.tokens_left - 1,
                          spec.k_for(rows), plain_horizon(r.processor, r.closer))) > 0]
    if not jobs:
        return out
    try:
        proposed = core.drafter.propose(jobs)
    except Exception as exc:  # NOTE: a failed draft only means no drafts (never inexact)
        log.warning("draft model failed (%r); decoding this step without drafts", exc)
        core.drafter.drop_all()
        return out
    out.update((sid, v) for sid, d in proposed.items()
               if (v := verifiable(core.requests[sid], d)))
    return out


def verifiable(req: EngineRequest, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """``drafts`` cut where they could not be accepted: past the rows plain decoding
    chooses with the grammar's own mask (:func:`plain_horizon`), and at the first token
    the grammar forbids there (its row's pick never is)."""
    horizon = plain_horizon(req.processor, req.closer)
    drafts = drafts[:horizon]
    if drafts and req.grammar is not None:
        # NOTE: issue 23: a first token that opens the reasoning block holds the grammar: the
        # rows after it are free, not the grammar's (so no drafts at that one position)
        drafts = () if req.processor.opener_ids() else drafts[:req.grammar.valid_prefix(drafts)]
    assert req.spec is not None  # NOTE: then a reasoning closer forced at the horizon
    return closer_after(req.spec, drafts, horizon, req.processor,
                        req.processor.tokens_left - 1)


def emit_verified(core: EngineCore, req: EngineRequest, decs: list[TokenDecision],
                   drafts: tuple[int, ...], base: SamplingRow, logits: torch.Tensor,
                   i: int) -> None:
    """Issue 21: emit the accepted drafts and the pick after them one by one through the
    exact loop, then roll the rejected tail back (coda.engine.speculative). ``decs``:
    rows ``0..k`` sampled (row 0 alone under a grammar), ``base`` row 0, ``logits[i + j]``
    row ``j``'s."""
    assert req.spec is not None
    forced = req.spec.forced  # NOTE: the forced path's rows (their one-token masks)
    held = req.held is not None  # NOTE: issue 23: rows sampled with the grammar held
    try:
        if req.grammar is not None:
            closer = req.closer
            decs, accepted = verify_constrained(
                base, decs[0], drafts, req.grammar,
                lambda j, row: core.sampler.sample(logits[i + j:i + j + 1], [row])[0],
                None if closer is None else
                lambda tok, ahead: closer.admits(tok, req.plan.eos_token_ids, ahead),
                forced, core._vocab)
        else:
            accepted = accepted_prefix(drafts, decs)
    except Exception as exc:  # NOTE: a grammar or closure fault fails only its request
        core._end_failed(req, exc)
        return
    req.spec.record(len(drafts), accepted)  # NOTE: evidence: the guesses before forced rows
    core._record(req, tr.SPECULATIVE, drafted=len(drafts), accepted=accepted,
                 rejected=len(drafts) - accepted, t=req.num_output_tokens + 1)
    for j, dec in enumerate(decs[:accepted + 1]):
        if j and not commit_draft(core, req):
            break
        # NOTE: a row sampled ahead assumed the loop forces forced[j] there (or nothing)
        # NOTE: or without the grammar's mask that the loop now applies (the row after the
        # reasoning closer: the answer's first token, issue 23)
        stale = j > 0 and (live_forced(req.processor, req.closer) != (
            forced[j] if j < len(forced) else None) or (held and req.held is None))
        last = j == accepted or stale
        if last:  # NOTE: the pick: what the per-token loop would make of it
            try:
                dec = live_pick(core, req, dec, logits[i + j:i + j + 1], stale)
            except Exception as exc:
                core._end_failed(req, exc)
                return
        core._on_decision(req, dec)
        if req.lifecycle.state is not State.DECODING:
            return  # NOTE: ended: its blocks went back with the KV resource
        if last:
            break
    core.scheduler.rollback(req)
    if core.drafter is not None:
        core.drafter.rollback(req)  # NOTE: the draft's rejected tail too


def commit_draft(core: EngineCore, req: EngineRequest) -> bool:
    """Before the next accepted token: the last one's K/V (this step's forward) becomes
    computed, with plain decoding's rows and count (L6, O1); then G1's checks as plain
    decoding's next step makes them. False: stop here (what was not emitted is dropped)."""
    if req.stream.should_pause:
        return False  # NOTE: P6: a paused reader stops here; the rest decodes later
    core.scheduler.commit_draft(req)
    core._record(req, tr.DECODE_STARTED, t=req.num_output_tokens)
    req.processed_output_tokens += max(0, req.num_computed_tokens - req.computed_high)
    req.computed_high = max(req.computed_high, req.num_computed_tokens)
    core._record(req, tr.DECODE_COMPLETED, t=req.num_output_tokens,
                 cache_len=req.num_computed_tokens)
    if req.cancel_pending:
        req.cancel()
    elif req.deadline is not None and core.clock() >= req.deadline:
        core._finish(req, FinishReason.DEADLINE_EXCEEDED)
    return req.lifecycle.state is State.DECODING


def live_pick(core: EngineCore, req: EngineRequest, dec: TokenDecision, logits: torch.Tensor,
               stale: bool) -> TokenDecision:
    """The pick of a verification (its last emitted row) as plain decoding makes it: a
    ``stale`` row (sampled ahead with another forced token than the loop's state now
    forces: a reasoning budget's closer at the horizon, :func:`plain_horizon`) is sampled
    again from the loop's own row; then the budget closer's check, as for every plain
    pick. Accepted rows before it need neither: the horizon and
    :func:`verify_constrained` stopped the run where they would."""
    if stale:
        dec = core.sampler.sample(logits.clone(), [req.sampling_row(core._vocab)])[0]
    if req.closer is not None:
        dec = core._keep_closable(req, dec, logits)
    return dec
