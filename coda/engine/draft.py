"""Exact draft-model speculative decoding (issue 21 item 2; SPEC T1, T3, T4, L7, O1).

``coda serve --draft-model MODEL`` (``--speculative draft``, implied by the flag) loads a second
model through the same loader as the target (:func:`coda.models.source.open_model`) and runs it
in the same engine, with its **own** paged KV cache (its own :class:`BlockManager`, no prefix
cache). The draft must share the target's tokenizer: the vocabularies (every token's id and
string, and the logits' width) are compared at start and a difference is refused with the
reason before anything is served (:func:`~coda.engine.draft_load.vocabulary_mismatch`; the
loading, and the mode from the flags, live in :mod:`coda.engine.draft_load`).

**Proposing** (:meth:`Drafter.propose`, before the target's step is scheduled). For each
speculating sequence about to choose output token ``t`` (one uncomputed token), the draft
first catches its cache up with the target's tokens (the prompt at first, later the one to
two tokens the last verification emitted), then chooses ``k`` tokens one forward at a time,
every sequence's row in one batched forward. Draft position ``j`` is chosen **with the same
draw as the target's row j**: the target's sampler on the draft's logits, with the very row
:func:`~coda.engine.speculative_verify.verify_rows` gives the target (the request's counter RNG at
output position ``t + j``, the prefix ``output + drafts[:j]`` for penalties and min_tokens;
greedy is the argmax; under a grammar, the mask of the target's grammar advanced through the
drafts before it, :class:`~coda.engine.grammar.Lookahead`, rolled back after proposing). Where
the two distributions are close the inverse-CDF draws coincide, so a seeded request's drafts
are accepted as often as greedy ones, and a constrained one's drafts are always grammatical.

**Verification** is unchanged (coda.engine.speculative: sample-and-match as extra rows of the
target's step), so exactness never depends on the draft: a wrong draft is only a rejected row.

**The draft's KV follows the accepted tokens exactly.** Its cache holds a prefix of the
target's tokens and the drafts fed after it; after a verification (:meth:`Drafter.rollback`)
and again before proposing, it is cut back to the longest common prefix with the target's
tokens (the rejected tail's blocks freed). A preempted target sequence drops its draft state
(:meth:`Drafter.drop`; the draft rebuilds it by prefill on the next proposal); the request's
end drops it through the same KV resource that frees the target's blocks, exactly once (L7).
A draft cache that is full, or a draft context that is too short, only means no drafts.

**How many (priced).** A draft token costs a draft forward, so prompt lookup's row rule is not
enough: the drafter times the target's decode steps (:meth:`Drafter.watch`) and its own
one-position forwards on its clock (``Drafter.clock``, injectable; on the CPU the engine
thread's CPU time), and each request gets the
``k`` that maximizes its expected tokens per second given its measured acceptance
(:class:`~coda.engine.speculative_costs.DraftCosts`; ``k`` from the request's state is only the
cap). ``k = 0`` when no ``k`` beats plain decoding; such a request re-probes with
``PROBE_K`` drafts after ``PROBE_EVERY`` plain steps, the wait doubling (up to
``PROBE_MAX``) while probes do not pay, so drafts that would pay come back (a draft too dear
to pay even when always accepted waits ``PROBE_MAX``: only its cost could change). ``costs = None``
drafts the cap every step (tests; no CLI flag sets it). Choosing ``k`` never changes the output.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from coda.engine.grammar import GrammarMatcher, Lookahead
from coda.engine.kv_cache import BlockManager
from coda.engine.runner import ModelRunner, SeqChunk
from coda.engine.sampler import Sampler, SamplingRow
from coda.engine.sequence import Sequence, SequenceStatus
from coda.engine.speculative import SpeculativeConfig
from coda.engine.speculative_costs import DraftCosts
from coda.engine.speculative_state import SpecState
from coda.engine.speculative_verify import row_at, verify_rows

# NOTE: a draft that shares the target's training agrees more often than prompt lookup (prior
# 0.8); k is priced by the drafter (DraftCosts), so the request's rule only caps it at k_max
DRAFT_CONFIG = SpeculativeConfig(k_max=6, prior_accept=0.8, step_rows=math.inf)
PROBE_K, PROBE_EVERY, PROBE_MAX = 2, 16, 256
_UNBOUNDED = 1 << 62


@dataclass(frozen=True)
class DraftJob:
    """One speculating sequence of the target (about to choose output token ``row.step``),
    with at most ``k`` drafts wanted, the target's sampling row for that token and its
    grammar (None: unconstrained), which the drafts follow and leave as it was."""

    seq: Sequence
    k: int
    row: SamplingRow
    grammar: GrammarMatcher | None = None


@dataclass
class _Priced:
    """One request's pricing state: its acceptance, the drafts awaiting their verification
    (the target's token count when they were drafted, the drafts) and its probe schedule."""

    spec: SpecState
    pending: tuple[int, tuple[int, ...]] | None = None
    idle: int = 0                      # plain steps since it last drafted
    every: int = PROBE_EVERY           # ... before it probes again


class Drafter:
    """The draft model, its KV cache and one draft sequence per speculating request."""

    def __init__(self, runner: ModelRunner, name: str,
                 eos_token_ids: frozenset[int] = frozenset(), *,
                 costs: DraftCosts | None = None,
                 clock: Callable[[], float] = time.monotonic, weights_bytes: int = 0) -> None:
        self.runner = runner
        self.name = name
        self.weights_bytes = weights_bytes  # NOTE: in the memory budget (load summary, issue 21)
        self.eos_token_ids = eos_token_ids
        self.blocks = BlockManager(runner.num_blocks, runner.block_size,
                                   enable_prefix_caching=False)  # NOTE: never a shared block
        self.sampler = Sampler()
        self.costs = costs   # None: draft what the request's state allows (eager)
        self.clock = clock
        self._seqs: dict[int, Sequence] = {}  # target seq id -> the draft's sequence
        self._priced: dict[int, _Priced] = {}

    def timed_forward(self, execute: Callable[[Seq[SeqChunk]], Any],
                      chunks: Seq[SeqChunk]) -> Any:
        """The engine's batch forward ``execute(chunks)``, timed on :attr:`clock` when every
        row is a decode or verify row (the verification's cost per drafted row against a
        plain step, :class:`DraftCosts`)."""
        start = self.clock()
        out = execute(chunks)
        if self.costs is not None and chunks and all(
                c.need_logits and len(c.token_ids) == c.num_logits for c in chunks):
            rows = sum(len(c.token_ids) for c in chunks)
            self.costs.observe_step(len(chunks), rows - len(chunks), self.clock() - start)
        return out

    # -- pricing -----------------------------------------------------------------------------
    def _settle(self, p: _Priced, tokens: Seq[int]) -> None:
        """Record the pending drafts' outcome once the target's tokens are past them."""
        if p.pending is None or len(tokens) <= p.pending[0]:
            return
        base, drafts = p.pending
        accepted = 0
        while (accepted < len(drafts) and base + accepted < len(tokens)
               and tokens[base + accepted] == drafts[accepted]):
            accepted += 1
        p.spec.record(len(drafts), accepted)
        p.pending = None

    def _price(self, job: DraftJob, seqs: int) -> int:
        """How many drafts ``job`` gets this step (the module docstring's pricing)."""
        if self.costs is None:
            return job.k
        sid = job.seq.seq_id
        p = self._priced.get(sid)
        if p is None:
            p = self._priced[sid] = _Priced(SpecState(DRAFT_CONFIG))
        self._settle(p, job.seq.all_token_ids)
        k = self.costs.choose(p.spec.acceptance, job.k, seqs)
        if k is None:
            return min(job.k, PROBE_K)  # NOTE: nothing measured yet: measure
        if k > 0:
            p.idle, p.every = 0, PROBE_EVERY
            return k
        if self.costs.choose(1.0, job.k, seqs) == 0:
            p.every = PROBE_MAX  # NOTE: not even a draft always accepted pays: costs only
        p.idle += 1
        if p.idle < p.every:
            return 0
        p.idle, p.every = 0, min(2 * p.every, PROBE_MAX)  # NOTE: a probe: acceptance, costs
        return min(job.k, PROBE_K)

    @property
    def num_live(self) -> int:
        """Sequences holding draft state (blocks)."""
        return len(self._seqs)

    # -- proposing ---------------------------------------------------------------------------
    def propose(self, jobs: Iterable[DraftJob]) -> dict[int, tuple[int, ...]]:
        """Up to ``job.k`` drafts per job (module docstring), by target sequence id."""
        ctx = self.runner.config.max_context
        live: list[tuple[DraftJob, Sequence, int]] = []
        jobs = list(jobs)
        for job in jobs:
            tokens = job.seq.all_token_ids
            k = min(self._price(job, len(jobs)),
                    ctx - len(tokens) + 1)  # NOTE: the last draft fed sits at len+k-2
            if k <= 0:
                continue
            d = self._synced(job.seq.seq_id, tokens)
            if d is None:
                continue
            need = len(tokens) + k - 1 - d.num_computed_tokens
            if not self.blocks.can_append(d, need):
                self.drop(job.seq.seq_id)  # NOTE: a full draft cache only means no drafts
                continue
            self.blocks.append(d, need)
            live.append((job, d, k))
        drafts: dict[int, list[int]] = {job.seq.seq_id: [] for job, _, _ in live}
        # NOTE: a constrained job's grammar advanced through its drafts, rolled back at the end
        aheads = {job.seq.seq_id: job.grammar.lookahead() for job, _, _ in live
                  if job.grammar is not None}
        try:
            self._draft(live, drafts, aheads)
        finally:
            for ahead in aheads.values():
                ahead.close()
        for sid in drafts:
            d = self._seqs[sid]
            self.blocks.truncate(d)  # NOTE: an early end (EOS) leaves unwritten blocks
            p = self._priced.get(sid)
            if p is not None:  # NOTE: all but the last draft were fed after the target's tokens
                p.pending = (len(d.prompt_token_ids) - len(drafts[sid]) + 1, tuple(drafts[sid]))
        return {sid: tuple(out) for sid, out in drafts.items()}

    def _draft(self, live: list[tuple[DraftJob, Sequence, int]], drafts: dict[int, list[int]],
               aheads: Mapping[int, Lookahead]) -> None:
        """The draft forwards: position ``j`` of every job in one batch, chosen with the
        target's row ``j`` (its grammar's mask after the drafts before it)."""
        while live:  # NOTE: one batched forward per draft position
            fed = [len(d.prompt_token_ids) - d.num_computed_tokens for _, d, _ in live]
            start = self.clock()
            logits = self.runner.execute([
                SeqChunk(tuple(d.prompt_token_ids[d.num_computed_tokens:]),
                         d.num_computed_tokens, tuple(d.block_table), True) for _, d, _ in live])
            # NOTE: the target's own row for output position t + j: the same draw (module doc)
            rows = [self._row(job, drafts[job.seq.seq_id], aheads) for job, _, _ in live]
            nxt: list[tuple[DraftJob, Sequence, int]] = []
            for (job, d, k), n, dec in zip(live, fed, self.sampler.sample(logits, rows),
                                           strict=True):
                d.num_computed_tokens += n
                out = drafts[job.seq.seq_id]
                out.append(dec.token_id)
                ahead = aheads.get(job.seq.seq_id)
                if len(out) < k and dec.token_id not in self.eos_token_ids and (
                        ahead is None or ahead.push(dec.token_id)):
                    d.prompt_token_ids.append(dec.token_id)  # NOTE: fed next round
                    nxt.append((job, d, k))
            if self.costs is not None and max(fed) == 1:  # NOTE: a prefill is no position
                self.costs.observe_draft(len(fed), self.clock() - start)
            live = nxt

    @staticmethod
    def _row(job: DraftJob, out: list[int], aheads: Mapping[int, Lookahead]) -> SamplingRow:
        """The target's row for the job's next draft position (after the drafts ``out``)."""
        ahead = aheads.get(job.seq.seq_id)
        if ahead is None or not out:
            return verify_rows(job.row, out)[-1]
        return row_at(job.row, out, len(out), ahead.mask())

    def _synced(self, seq_id: int, tokens: list[int]) -> Sequence | None:
        """The draft sequence of ``seq_id`` holding the longest cached prefix of ``tokens``
        (created and allocated on first use), its known tokens set to ``tokens``."""
        d = self._seqs.get(seq_id)
        if d is None:
            d = Sequence(seq_id, list(tokens), _UNBOUNDED, status=SequenceStatus.RUNNING)
            if not self.blocks.can_allocate(d):
                return None
            self.blocks.allocate(d)
            self._seqs[seq_id] = d
            return d
        self._cut(d, tokens)
        d.prompt_token_ids[d.num_computed_tokens:] = tokens[d.num_computed_tokens:]
        return d

    def _cut(self, d: Sequence, tokens: Seq[int]) -> None:
        """Keep only the cached prefix ``d`` shares with ``tokens``, and at least one token of
        ``tokens`` uncomputed (the logits of the last one are the first draft's)."""
        have = d.prompt_token_ids
        n = min(d.num_computed_tokens, len(tokens) - 1)
        lcp = 0
        while lcp < n and have[lcp] == tokens[lcp]:
            lcp += 1
        d.num_computed_tokens = lcp
        del have[lcp:]
        self.blocks.truncate(d)

    # -- following the target ----------------------------------------------------------------
    def rollback(self, seq: Sequence) -> None:
        """After a verification: drop the draft's rejected tail (its blocks freed)."""
        d = self._seqs.get(seq.seq_id)
        if d is not None:
            self._cut(d, seq.all_token_ids)
        p = self._priced.get(seq.seq_id)
        if p is not None:
            self._settle(p, seq.all_token_ids)

    def drop(self, seq_id: int) -> None:
        """Free ``seq_id``'s draft state (preemption, the request's end; idempotent)."""
        self._priced.pop(seq_id, None)
        d = self._seqs.pop(seq_id, None)
        if d is not None and self.blocks.is_allocated(d):
            self.blocks.free(d)

    def drop_all(self) -> None:
        for sid in list(self._seqs):
            self.drop(sid)
