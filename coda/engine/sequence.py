"""The scheduler's view of one request (SPEC T1, T4). Pure bookkeeping: no torch.

A :class:`Sequence` is owned by the engine; the scheduler moves it between queues and the
block manager fills its ``block_table``. Index ranges over ``all_token_ids``::

    all_token_ids:  | prompt (P)            | outputs (selected, O)    |
    index:          0                       P                          P+O
    computed:       [0 ............ num_computed_tokens)
    to compute:                             [num_computed_tokens ..... P+O)

    T1: once prefill is done, P+O - num_computed_tokens is 0 (logits ready, about to
        select) or 1 (just selected y_t, its K/V not yet in the cache).
    T4: preemption by recompute resets num_computed_tokens to 0 but keeps the outputs, so
        the resumed prefill recomputes prompt+outputs and the next token is chosen at the
        same position from the same prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class SequenceStatus(Enum):
    """Where a sequence is in the scheduler: queued, holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request's token state. Identity is the object (``eq=False``); ids are unique.

    Contract:
      * ``output_token_ids`` holds tokens SELECTED so far; the engine calls
        :meth:`append_token` only when every known token is in the cache (T1).
      * ``num_computed_tokens`` counts tokens whose K/V are in the cache; only the
        scheduler changes it (advance after a step, reset on preemption).
      * ``block_table`` is written only by the block manager.
      * ``max_total_tokens`` (prompt + max output) bounds ``num_tokens``; it fits the whole
        cache (the plan refused any that could not, coda.engine.plan).
    """

    seq_id: int
    prompt_token_ids: list[int]
    max_total_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    arrival: int = -1  # NOTE: assigned by Scheduler.add (monotonic admission order)
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        if self.max_total_tokens < self.num_tokens:
            raise ValueError(
                f"max_total_tokens={self.max_total_tokens} < current length {self.num_tokens}"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by selected outputs (a fresh list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens known but not yet in the cache (the next chunk comes from these)."""
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        """Record a selected token (T1: only when logits are for the whole known prefix)."""
        if self.status is not SequenceStatus.RUNNING:
            raise ValueError(f"seq {self.seq_id}: append_token while {self.status.name}")
        if self.num_computed_tokens != self.num_tokens:
            # NOTE: T1 — logits exist only for a fully computed prefix; selecting twice
            # without a decode in between would break "selected - in cache <= 1".
            raise ValueError(
                f"seq {self.seq_id}: append_token with {self.num_uncomputed_tokens} "
                "uncomputed tokens (T1)"
            )
        if self.num_tokens >= self.max_total_tokens:
            raise ValueError(f"seq {self.seq_id}: exceeds max_total_tokens")
        self.output_token_ids.append(token_id)
