"""A failed forward in the engine step (seed 004, D5): the batch run again chunk by chunk so the
culprit fails alone, then each failed request retried before its first frame or ended. A step
whose forward succeeds never enters this module (``EngineCore._execute``,
``EngineCore._triage_failures``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from coda import trace as tr
from coda.early_stop_failure import decide_stream_failure
from coda.engine.runner import SeqChunk
from coda.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from coda.engine.core import EngineCore


def isolate(core: EngineCore, out: SchedulerOutput, chunks: list[SeqChunk]
            ) -> tuple[torch.Tensor, dict[int, BaseException]]:
    """After a failed batch forward: each chunk again alone, so one bad request fails alone
    (its rows zeros, its failure kept for :func:`triage`)."""
    rows: list[torch.Tensor] = []
    failed: dict[int, BaseException] = {}
    for sc, chunk in zip(out.chunks, chunks, strict=True):
        try:
            res = core.runner.execute([chunk])
        except Exception as exc:
            failed[sc.seq.seq_id] = exc
            res = None
        if chunk.need_logits:
            rows.append(res if res is not None else
                        torch.zeros(chunk.num_logits, core.runner.config.vocab_size))
    return (torch.cat(rows) if rows else torch.empty(0)), failed


def triage(core: EngineCore, failed: dict[int, BaseException]) -> None:
    """Retry a failed forward only before the first frame (seed 004, D5): the step is
    recomputed next time (the sampler is counter-based, so the output is unchanged).
    Otherwise the request ends FAILED(model_error) and its committed tokens are billed."""
    for sid, exc in failed.items():
        req = core.requests.get(sid)
        if req is None or req.lifecycle.is_terminal:
            continue
        policy = req.early_stop.policy if req.early_stop is not None else None
        decision = decide_stream_failure(
            first_frame_sent=req.stream.last_seq > 0,  # seq 0 is the start event
            error_retryable=req.retries < core.max_forward_retries,
            no_retry_after_first_frame=(policy.no_retry_after_first_frame
                                        if policy is not None else True),
            committed_tokens=req.processor.generated)
        core._record(req, tr.ERROR, error=repr(exc), retryable=decision.retryable,
                     decision=decision.reason.value,
                     committed_tokens=decision.committed_tokens)
        if decision.retryable:
            req.retries += 1
            core.num_retries_total += 1
        else:
            core._end_failed(req, exc)
