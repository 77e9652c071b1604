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

from enum import Enum


class SequenceStatus(Enum):
    """Where a sequence is in the scheduler: queued, holding KV blocks, or done."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """One request's token state. Identity is the object (no ``__eq__``); ids are unique.

    The engine's live request (:class:`~coda.engine.engine_request.EngineRequest`) *is* its sequence
    (issue 22: one live object per request): it calls this ``__init__`` beside the run's, so
    the scheduler, the block manager and the drafter read the same object the engine ends;
    tested alone here, with no engine. A draft model's cache keeps plain sequences
    (coda.engine.draft).

    Contract:
      * ``output_token_ids`` holds tokens SELECTED so far; the engine calls
        :meth:`append_token` only when every known token is in the cache (T1).
      * ``num_computed_tokens`` counts tokens whose K/V are in the cache; only the
        scheduler changes it (advance after a step, reset on preemption).
      * ``block_table`` is written only by the block manager, and so are its prefix-cache
        registration cursor ``hashed_blocks`` (leading blocks already considered) and
        ``hash_chain_ok`` (False once a block could not be registered: the blocks after it
        are unreachable by a verified lookup), both reset at each allocation.
      * ``max_total_tokens`` (prompt + max output) bounds ``num_tokens``; it fits the whole
        cache (the plan refused any that could not, coda.engine.plan).
      * ``admitted`` is the admission order, assigned by ``Scheduler.add`` (-1 before).
    """

    def __init__(self, seq_id: int, prompt_token_ids: list[int], max_total_tokens: int, *,
                 status: SequenceStatus = SequenceStatus.WAITING) -> None:
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        if max_total_tokens < len(prompt_token_ids):
            raise ValueError(
                f"max_total_tokens={max_total_tokens} < current length {len(prompt_token_ids)}"
            )
        self.seq_id = seq_id
        self.prompt_token_ids = prompt_token_ids
        self.max_total_tokens = max_total_tokens
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.hashed_blocks = 0
        self.hash_chain_ok = True
        self.status = status
        self.admitted = -1  # NOTE: assigned by Scheduler.add (monotonic admission order)
        self.num_preemptions = 0
        self.dropped = (0, 0)  # NOTE: (tokens, blocks) the last preemption dropped (O1, T4)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(seq_id={self.seq_id}, tokens={self.num_prompt_tokens}"
                f"+{self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.name})")

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
