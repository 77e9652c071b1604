"""Continuous-batching scheduler (SPEC T1, T3, T4, L7). Pure bookkeeping: no torch.

One verb covers prefill, chunked prefill, decode and recompute after preemption: every
scheduled sequence computes the next ``k`` of its known-but-uncomputed tokens::

    all_token_ids:  | prompt .............. | outputs (selected) ... |
                    0                       P                        P+O = num_tokens
    in cache:       [0 ... num_computed)
    this step:                [num_computed ... num_computed + k)
    need_logits:    num_computed + k == num_tokens   (the chunk reaches the end)

    decode:    k = 1 (the token selected last step, T1)
    prefill:   k <= long_prefill_chunk, within the step's token budget
    resume:    after preemption num_computed = 0, so prompt+outputs are recomputed and the
               next token is selected at the same position (T4)

A step is ``schedule()`` -> run the model on ``output.chunks`` -> ``on_step_done(output)``
-> the engine appends selected tokens (chunks with ``need_logits``) and calls ``finish``
or ``abort`` for sequences that ended (T2: they are never scheduled again).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from coda.engine.kv_cache import BlockManager
from coda.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Batch limits: sequences per step, tokens per step, prefill chunk per sequence, and the
    prompt rows scored per step (each holds a whole vocabulary of logits: O1, echo)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_chunk: int = 512
    enable_prefix_caching: bool = True
    scoring_rows: int = 512

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "long_prefill_chunk",
                     "scoring_rows"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SchedulerConfig.{name} must be positive")


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``token_ids`` of ``seq`` at positions ``start_pos ..`` to compute this step.

    ``num_draft`` (issue 21, coda.engine.speculative): the last ``num_draft`` tokens are
    drafted, not selected: their K/V is written but not counted as computed until the engine
    commits it (:meth:`Scheduler.commit_draft`); every one of the chunk's last
    ``1 + num_draft`` rows needs logits."""

    seq: Sequence
    token_ids: tuple[int, ...]
    start_pos: int
    need_logits: bool
    num_draft: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption by recompute.

    Contract:
      * Running sequences are served first (oldest first), then waiting ones in arrival
        order; admission stops at the first that does not fit (no overtaking, no
        preempting to admit).
      * A running sequence that cannot get a block preempts the most recently arrived
        running sequence (possibly itself): its blocks are freed, ``num_computed_tokens``
        drops to 0 and it goes to the front of waiting; its selected tokens are kept (T4).
      * Every sequence's blocks are freed exactly once per allocation (L7): by preemption,
        ``finish`` or ``abort``.
    """

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.enable_prefix_caching != block_manager.enable_prefix_caching:
            raise ValueError("SchedulerConfig and BlockManager disagree on prefix caching")
        self.config = config
        self.block_manager = block_manager
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # NOTE: kept sorted by admission order
        self._by_id: dict[int, Sequence] = {}
        self._next_admitted = 0

    # ----- queues ----------------------------------------------------------------------
    @property
    def waiting(self) -> list[Sequence]:
        return list(self._waiting)

    @property
    def running(self) -> list[Sequence]:
        return list(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def get(self, seq_id: int) -> Sequence | None:
        return self._by_id.get(seq_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Its bound fits the whole cache: the plan admitted it (the one
        "can it ever fit" check, coda.engine.plan, T3/D1); here only "does it fit now" is
        asked, at each step."""
        if seq.seq_id in self._by_id:
            raise ValueError(f"seq {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"seq {seq.seq_id} is not a fresh sequence")
        seq.admitted = self._next_admitted
        self._next_admitted += 1
        self._waiting.append(seq)
        self._by_id[seq.seq_id] = seq

    def finish(self, seq: Sequence) -> None:
        """End a sequence the engine is done with; frees its blocks exactly once (L7)."""
        if self._by_id.get(seq.seq_id) is not seq:
            raise ValueError(f"seq {seq.seq_id} is not scheduled (finished twice?)")
        self._remove(seq)

    def abort(self, seq_id: int) -> Sequence | None:
        """Remove a sequence from whichever queue holds it; None if unknown or ended."""
        seq = self._by_id.get(seq_id)
        if seq is not None:
            self._remove(seq)
        return seq

    def _remove(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self._running.remove(seq)
            self.block_manager.free(seq)
        else:
            self._waiting.remove(seq)  # NOTE: waiting sequences hold no blocks
        del self._by_id[seq.seq_id]
        seq.status = SequenceStatus.FINISHED

    # ----- one step ----------------------------------------------------------------------
    def schedule(self, paused: frozenset[int] = frozenset(),
                 drafts: Mapping[int, tuple[int, ...]] | None = None,
                 fresh: frozenset[int] = frozenset()) -> SchedulerOutput:
        """Pick this step's chunks: running sequences first, then admit waiting ones.

        Running sequences whose id is in ``paused`` keep their blocks but are not stepped
        (backpressure policy 1, P6): they resume at the same token and position. A decoding
        sequence with ``drafts`` carries them after its token when the step's budget and the
        free blocks allow (never by preempting: a draft that does not fit is dropped).
        A sequence whose id is in ``fresh`` scores its prompt (every position computed, every
        row's logits kept: coda.engine.core): it is admitted without prefix-cache reuse, and
        such sequences compute at most ``scoring_rows`` positions per step between them.
        """
        cfg, bm = self.config, self.block_manager
        budget = cfg.max_num_batched_tokens
        scoring = cfg.scoring_rows  # NOTE: rows of [rows, vocab] logits left this step
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            if seq.seq_id in paused:
                i += 1
                continue
            k = min(seq.num_uncomputed_tokens, cfg.long_prefill_chunk, budget)
            if seq.seq_id in fresh:
                k = min(k, scoring)
            if k == 0:  # NOTE: nothing to compute yet, or no scoring rows left this step
                i += 1
                continue
            # NOTE: drafts never take a later running sequence's decode token from the budget
            room = budget - (len(self._running) - i - 1)
            draft = self._fit_draft(seq, k, drafts.get(seq.seq_id, ()) if drafts else (), room)
            k += len(draft)
            while not bm.can_append(seq, k):
                victim = self._running[-1]  # most recently admitted (list sorted by admission)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # NOTE: seq preempted itself, and it was the last running one
            bm.append(seq, k)
            chunks.append(self._chunk(seq, k, draft))
            budget -= k
            scoring -= k if seq.seq_id in fresh else 0
            i += 1
        # NOTE: after a preemption, admit nothing this step (it would thrash on the freed blocks).
        while self._waiting and not preempted and budget > 0:
            if len(self._running) >= cfg.max_num_seqs:
                break
            seq = self._waiting[0]
            reuse = seq.seq_id not in fresh
            if not reuse and scoring == 0:
                break  # NOTE: FCFS: it waits for the next step's scoring rows
            if not bm.can_allocate(seq, reuse):
                break  # NOTE: FCFS — no overtaking, no preempting to admit
            self._waiting.popleft()
            bm.allocate(seq, reuse)  # may set num_computed_tokens on a prefix hit
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self._running, seq, key=lambda s: s.admitted)
            k = min(seq.num_uncomputed_tokens, cfg.long_prefill_chunk, budget,
                    budget if reuse else scoring)
            chunks.append(self._chunk(seq, k))
            budget -= k
            scoring -= 0 if reuse else k
        return SchedulerOutput(chunks, preempted)

    def _fit_draft(self, seq: Sequence, k: int, draft: tuple[int, ...],
                   budget: int) -> tuple[int, ...]:
        if not draft or k != 1 or seq.num_uncomputed_tokens != 1:
            return ()
        draft = draft[: budget - 1]
        return draft if draft and self.block_manager.can_append(seq, 1 + len(draft)) else ()

    def _chunk(self, seq: Sequence, k: int, draft: tuple[int, ...] = ()) -> ScheduledChunk:
        start, own = seq.num_computed_tokens, k - len(draft)
        tokens = tuple(seq.all_token_ids[start : start + own]) + draft
        return ScheduledChunk(seq, tokens, start, need_logits=start + own == seq.num_tokens,
                              num_draft=len(draft))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-preemption (T4): drop K/V, keep selected tokens, requeue at the front."""
        self._running.remove(seq)
        seq.dropped = (seq.num_computed_tokens, len(seq.block_table))  # NOTE: its trace row's
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)

    def on_step_done(self, output: SchedulerOutput, skip: frozenset[int] = frozenset()) -> None:
        """Mark each chunk's tokens as in the cache and register full blocks for reuse.

        Chunks of sequences aborted since ``schedule()`` are skipped (their blocks are gone),
        and so are chunks whose forward failed (``skip``): their K/V is not trusted, is never
        registered for prefix reuse, and the same chunk is scheduled again (a retry).
        """
        for chunk in output.chunks:
            seq = chunk.seq
            if seq.status is not SequenceStatus.RUNNING or self._by_id.get(seq.seq_id) is not seq:
                continue
            if seq.seq_id in skip:
                if chunk.num_draft:
                    self.rollback(seq)  # NOTE: a failed verification's drafts hold no blocks
                continue
            if seq.num_computed_tokens != chunk.start_pos:
                raise RuntimeError(f"seq {seq.seq_id}: step result out of order")
            seq.num_computed_tokens += chunk.num_tokens - chunk.num_draft
            self.block_manager.cache_computed_blocks(seq)

    def commit_draft(self, seq: Sequence) -> None:
        """The engine accepted the drafted token just appended to ``seq``: its K/V, written by
        this step's forward, is now computed (and its full blocks registered for reuse)."""
        if seq.num_computed_tokens + 1 != seq.num_tokens:
            raise RuntimeError(f"seq {seq.seq_id}: commit_draft without an appended draft")
        seq.num_computed_tokens += 1
        self.block_manager.cache_computed_blocks(seq)

    def rollback(self, seq: Sequence) -> None:
        """Free the blocks past the computed tokens (a verification's rejected drafts): the
        sequence holds what plain decoding would hold."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.truncate(seq)
