"""An embedding on the engine thread, run in chunks between steps (SPEC L7, C1; issue 23
item 2, the fuzz sweep's frozen engine).

One forward over a long input held the engine thread for its whole length: a 7,000-token
``/v1/embeddings`` kept a 2-token chat waiting 169 s, and an input whose client had left ran to
its end. Now an :class:`EmbedJob` runs one chunk (the scheduler's ``long_prefill_chunk``) per
engine-loop turn over its own scratch KV cache, so other requests' steps run between its
chunks, as a chunked chat prefill's do. Its caller's :class:`~concurrent.futures.Future` stays
pending while it runs (a running one could no longer be cancelled): a cancelled future (the
awaiting task cancelled, its client gone) stops the job at the next chunk boundary and drops
its scratch cache. The vector is the float64 mean of every hidden row at once
(:meth:`~coda.engine.runner.ModelRunner.embed_pool`), the same sum over the same rows as one
forward gave.
"""

from __future__ import annotations

from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from coda.engine.runner import ModelRunner
    from coda.models.attention import PagedKVCache


@dataclass
class EmbedJob:
    """One embedding's state between chunks: its ids, its caller's future, the chunk size,
    the scratch cache (made at its first chunk), the next position and the hidden rows so far."""

    token_ids: list[int]
    future: Future[list[float]]
    chunk: int
    scratch: PagedKVCache | None = None
    pos: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self.future.cancelled()

    def advance(self, runner: ModelRunner) -> bool:
        """Run the next chunk; True once the job has ended (its future answered: the vector,
        or the refusal its input met). The caller checks :attr:`cancelled` first."""
        try:
            if self.scratch is None:
                self.scratch = runner.embed_scratch(len(self.token_ids))
            end = min(self.pos + self.chunk, len(self.token_ids))
            self.rows.append(runner.embed_rows(self.scratch, self.token_ids, self.pos, end))
            self.pos = end
            if self.pos < len(self.token_ids):
                return False
            vector = runner.embed_pool(self.rows)
        except Exception as exc:  # NOTE: the caller's error, never the engine loop's
            self.answer(exc)
            return True
        self.answer(vector)
        return True

    def answer(self, outcome: list[float] | BaseException) -> None:
        """End the job: its future gets ``outcome`` (unless its caller cancelled it), and its
        scratch cache and rows are dropped."""
        self.release()
        try:
            if isinstance(outcome, BaseException):
                self.future.set_exception(outcome)
            else:
                self.future.set_result(outcome)
        except InvalidStateError:
            pass  # NOTE: cancelled since the last check: nobody waits for it

    def release(self) -> None:
        """Drop what the job holds (its scratch cache, its hidden rows)."""
        self.scratch = None
        self.rows = []
