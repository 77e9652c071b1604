"""The step's token choice (SPEC G1, C2; issue 13, issue 21): which rows of the step's logits
belong to which request (:func:`logit_rows`), and choosing each live request's next token from
its row(s) (:func:`choose`). Runs on the engine thread, inside :meth:`EngineCore.step
<coda.engine.core.EngineCore.step>`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from coda import trace as tr
from coda.engine.core_spec import emit_verified
from coda.engine.runner import SeqChunk
from coda.engine.sampler import SamplingRow
from coda.engine.scheduler import ScheduledChunk, SchedulerOutput
from coda.engine.speculative_verify import verify_rows
from coda.finish import FinishReason
from coda.lifecycle import State

if TYPE_CHECKING:
    from coda.engine.core import EngineCore
    from coda.engine.engine_request import EngineRequest


def choose(core: EngineCore, rows: list[tuple[EngineRequest, int, ScheduledChunk]],
           logits: torch.Tensor) -> None:
    """G1, C2: each row's request is checked (cancel, then deadline, then a spent budget)
    and the rest draw their tokens in one sampling call: a verification's ``1 + k`` rows
    (coda.engine.core_spec), else one, kept closable (issue 13), then each decision
    applied (``EngineCore._on_decision``)."""
    live: list[tuple[EngineRequest, int, tuple[int, ...]]] = []
    for req, i, chunk in rows:
        if req.lifecycle.state is State.PREFILLING:
            req.lifecycle.transition(State.DECODING)
            req.decode_started = core.clock()
            core._record(req, tr.PREFILL_COMPLETED, cache_len=req.num_computed_tokens)
        # G1: cancel -> deadline -> choose (C2: a step that finished after the cancel is discarded)
        if req.cancel_pending:
            req.cancel()
        elif req.deadline is not None and core.clock() >= req.deadline:
            core._finish(req, FinishReason.DEADLINE_EXCEEDED)
        elif req.processor.budget_spent:  # NOTE: a budget of 0: prefill only, no token
            core._finish(req, req.plan.budget_end)
        else:
            live.append((req, i, chunk.token_ids[chunk.num_tokens - chunk.num_draft:]))
    if not live:
        return
    sampling_rows: list[SamplingRow] = []
    ok: list[tuple[EngineRequest, int, tuple[int, ...], SamplingRow]] = []
    index: list[int] = []
    for req, i, drafts in live:
        try:  # NOTE: a verification samples 1 + k rows (coda.engine.speculative); under a
            # grammar only row 0 here, the others once the drafts before them are accepted
            base = req.sampling_row(core._vocab)
            # NOTE: no drafts (issue 22): row 0 is base itself, no call into the drafting
            sampled = [base] if req.grammar is not None or not drafts else verify_rows(
                base, drafts, req.spec.forced if req.spec else (), core._vocab)
            sampling_rows.extend(sampled)
            ok.append((req, i, drafts, base))
            index.extend(range(i, i + len(sampled)))
        except Exception as exc:  # one broken grammar fails only its own request
            core._end_failed(req, exc)
    if not ok:
        return
    try:
        # NOTE: every row in order (a plain decode step): the logits themselves, not an
        # identical copy (the sampler never writes into its input)
        picked = logits if index == list(range(logits.shape[0])) else logits.index_select(
            0, torch.tensor(index, dtype=torch.long))
        decisions = core.sampler.sample(picked, sampling_rows)
    except Exception as exc:
        for req, _, _, _ in ok:
            core._end_failed(req, exc)
        return
    at = 0
    for req, i, drafts, base in ok:
        n = 1 if req.grammar is not None else 1 + len(drafts)
        dec, at = decisions[at], at + n
        if drafts:
            emit_verified(core, req, decisions[at - n:at], drafts, base, logits, i)
            continue
        if req.closer is not None:
            try:
                dec = core._keep_closable(req, dec, logits[i:i + 1])
            except Exception as exc:  # NOTE: a closure fault fails only its own request
                core._end_failed(req, exc)
                continue
        core._on_decision(req, dec)


def logit_rows(out: SchedulerOutput, chunks: list[SeqChunk]
                ) -> list[tuple[int, ScheduledChunk, int]]:
    """Each chunk that has logits rows: the index of its first one and how many of them score
    prompt tokens (they come first; then a verification's ``1 + num_draft`` rows,
    coda.engine.speculative, or the one row of the next token)."""
    rows, at = [], 0
    for chunk, sc in zip(out.chunks, chunks, strict=True):
        if sc.need_logits:
            own = 1 + chunk.num_draft if chunk.need_logits else 0
            rows.append((at, chunk, sc.num_logits - own))
            at += sc.num_logits
    return rows
