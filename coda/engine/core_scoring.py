"""Prompt scoring (SPEC O1, echo): the rows of a request asking ``prompt_logprobs`` that score
its prompt tokens become their records, in the step that computed them. A step without
scoring rows never enters this module (``EngineCore._score``); which rows score:
``EngineCore._scored_rows``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from coda.engine.scheduler import ScheduledChunk
from coda.errors import ModelError

if TYPE_CHECKING:
    from coda.engine.core import EngineCore


def score_prompt(core: EngineCore, spans: list[tuple[int, ScheduledChunk, int]],
                 logits: torch.Tensor, failed: dict[int, BaseException]) -> None:
    """O1, echo: each scoring row becomes its prompt token's record, reduced from the
    chunk's logits right away (never ``[prompt, vocab]`` at once): exactly the record
    decoding that token after the tokens before it reports (Sampler.score; the same bits
    in a batch-invariant mode, T4). A row recomputed after a preemption is not scored
    twice; a failed forward's rows are scored when the chunk is retried."""
    for at, chunk, n in spans:
        sid = chunk.seq.seq_id
        req = core.requests.get(sid)
        if not n or req is None or req.lifecycle.is_terminal or sid in failed:
            continue
        done = len(req.prompt_logprobs)  # NOTE: tokens 1 .. done are scored
        skip = max(0, done - chunk.start_pos)
        if chunk.start_pos > done:  # NOTE: no reuse, so positions come in order
            core._end_failed(req, ModelError(f"prompt scoring skipped positions "
                                             f"{done}..{chunk.start_pos}"))
            continue
        prompt = chunk.seq.prompt_token_ids
        targets = prompt[chunk.start_pos + 1 + skip:chunk.start_pos + 1 + n]
        k = req.plan.prompt_logprobs or 0
        try:
            decs = core.sampler.score(logits[at + skip:at + n], targets, k)
        except Exception as exc:  # NOTE: a bad row fails only its own request
            core._end_failed(req, exc)
            continue
        req.prompt_logprobs.extend(core._logprob_info(d) for d in decs)
        if len(req.prompt_logprobs) >= len(prompt) - 1:
            core._scoring.discard(sid)  # NOTE: a recompute may reuse the cache again
