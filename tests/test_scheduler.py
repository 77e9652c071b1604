"""Continuous-batching scheduler: admission, budgets, chunked prefill, preemption (T1, T4, L7).

The "model" here is deterministic and reads its context back from a fake paged KV store
(:class:`tests.test_kv_cache.FakeKV`), so a wrong block table or prefix hit changes the output.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.kv_cache import BlockManager
from coda.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from coda.engine.sequence import Sequence, SequenceStatus
from tests.conftest import examples
from tests.test_kv_cache import FakeKV

VOCAB = 7


def next_token(context: list[int]) -> int:
    """Deterministic stand-in for a forward pass + greedy choice over the whole context."""
    return (sum((i + 1) * t for i, t in enumerate(context)) * 31 + len(context)) % VOCAB


def reference(prompt: list[int], max_out: int) -> list[int]:
    out: list[int] = []
    for _ in range(max_out):
        out.append(next_token(prompt + out))
    return out


class Harness:
    """The engine's side of a step: run chunks, advance, select, finish at max tokens."""

    def __init__(self, num_blocks: int, block_size: int = 2, **cfg: int | bool) -> None:
        caching = bool(cfg.pop("enable_prefix_caching", True))
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.sched = Scheduler(SchedulerConfig(enable_prefix_caching=caching, **cfg), self.bm)
        self.kv = FakeKV(self.bm)
        self.done: dict[int, list[int]] = {}
        self.next_id = 0
        self.fresh: set[int] = set()  # NOTE: the sequences scoring their prompt (O1, echo)

    def add(self, prompt: list[int], max_out: int) -> Sequence:
        seq = Sequence(self.next_id, list(prompt), len(prompt) + max_out)
        self.next_id += 1
        self.sched.add(seq)
        return seq

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule(fresh=frozenset(self.fresh))
        self.bm.check_integrity()
        chosen: dict[int, int] = {}
        for c in out.chunks:
            assert c.token_ids == tuple(
                c.seq.all_token_ids[c.start_pos : c.start_pos + c.num_tokens]
            )
            self.kv.write(c.seq, c.start_pos, c.token_ids)
            if c.need_logits:
                chosen[c.seq.seq_id] = next_token(self.kv.read(c.seq, c.start_pos + c.num_tokens))
        self.sched.on_step_done(out)
        for c in out.chunks:
            seq = c.seq
            if seq.seq_id in chosen and seq.status is SequenceStatus.RUNNING:
                self.select(seq, chosen[seq.seq_id])
        self.bm.check_integrity()
        return out

    def select(self, seq: Sequence, token: int) -> None:
        seq.append_token(token)
        assert seq.num_uncomputed_tokens == 1  # T1: selected - in cache == 1
        if seq.num_tokens == seq.max_total_tokens:
            self.sched.finish(seq)
            self.done[seq.seq_id] = list(seq.output_token_ids)

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work:
                break
            self.step()
        assert not self.sched.has_work
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.usage == 0.0


def test_admission_by_kv_capacity() -> None:
    h = Harness(num_blocks=4, block_size=4)
    seqs = [h.add(list(range(1, 8)), 3) for _ in range(3)]  # 2 blocks each
    out = h.step()
    assert [c.seq for c in out.chunks] == seqs[:2]
    assert h.sched.num_running == 2 and h.sched.num_waiting == 1
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].block_table == []
    h.drain()
    assert h.done == {s.seq_id: reference(s.prompt_token_ids, 3) for s in seqs}


def test_max_num_seqs_and_token_budget() -> None:
    h = Harness(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=10)
    a, b, c = (h.add([1, 2, 3, 4, 5, 6], 2) for _ in range(3))
    out = h.step()
    # NOTE: budget 10 = a's 6 + a 4-token chunk of b; c waits for a seat (max_num_seqs).
    assert [(x.seq, x.num_tokens, x.need_logits) for x in out.chunks] == [
        (a, 6, True),
        (b, 4, False),
    ]
    assert out.num_batched_tokens == 10 and h.sched.waiting == [c]
    h.drain()
    assert len(h.done) == 3


def test_chunked_prefill_keeps_blocks_and_stays_running() -> None:
    h = Harness(num_blocks=16, long_prefill_chunk=4)
    seq = h.add(list(range(10)), 2)
    spans = []
    for _ in range(3):
        out = h.step()
        (chunk,) = out.chunks
        spans.append((chunk.start_pos, chunk.num_tokens, chunk.need_logits))
        assert seq.status is SequenceStatus.RUNNING and len(seq.block_table) >= 5
    assert spans == [(0, 4, False), (4, 4, False), (8, 2, True)]
    assert seq.num_output_tokens == 1
    h.drain()
    assert h.done[seq.seq_id] == reference(list(range(10)), 2)


def test_decode_first_then_prefill() -> None:
    h = Harness(num_blocks=32, long_prefill_chunk=4)
    a = h.add([1, 2, 3], 5)
    h.step()
    b = h.add([4, 5, 6, 7, 8], 2)
    out = h.step()
    assert [(c.seq, c.num_tokens) for c in out.chunks] == [(a, 1), (b, 4)]
    assert out.chunks[0].start_pos == 3 and out.chunks[0].need_logits


def test_t3_a_sequence_filling_the_whole_cache_is_queued_and_runs_to_its_bound() -> None:
    """T3: the scheduler asks only "does it fit now" (whether it can ever fit is the plan's
    one check, tests/test_kv_budget.py): a sequence bounded by exactly every slot of the cache
    is queued behind another that holds blocks, and both run to their bounds."""
    h = Harness(num_blocks=4, block_size=2)
    first = h.add([5, 6], 3)
    h.step()
    full = h.add([1, 2, 3], 5)  # NOTE: exactly 8 tokens = 8 slots
    h.drain()
    assert h.done == {first.seq_id: reference([5, 6], 3), full.seq_id: reference([1, 2, 3], 5)}


@pytest.mark.parametrize("caching", [True, False])
def test_t4_preemption_by_recompute_gives_identical_outputs(caching: bool) -> None:
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 6], [2, 2, 2, 2, 2, 2, 2], [6, 5]]
    small = Harness(num_blocks=10, block_size=2, enable_prefix_caching=caching)
    seqs = [small.add(p, 9) for p in prompts]
    preempted: list[Sequence] = []
    while small.sched.has_work:
        out = small.step()
        preempted += out.preempted
        for s in out.preempted:  # recompute: K/V dropped, selected tokens kept
            assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0
            assert s.block_table == [] and small.sched.waiting[0] in out.preempted
    assert preempted and sum(s.num_preemptions for s in seqs) == len(preempted)
    big = Harness(num_blocks=100, block_size=2, enable_prefix_caching=caching)
    for p in prompts:
        big.add(p, 9)
    big.drain()
    assert small.done == big.done == {i: reference(p, 9) for i, p in enumerate(prompts)}
    assert small.bm.num_free_blocks == small.bm.num_blocks


def test_t4_preempted_sequence_resumes_at_same_position() -> None:
    h = Harness(num_blocks=6, block_size=2)
    a, b = h.add([1, 2, 3], 8), h.add([4, 5, 6], 8)
    victim_state = None
    while victim_state is None:
        out = h.step()
        if out.preempted:
            assert out.preempted == [b] and h.sched.running == [a]  # newest arrival goes
            victim_state = (list(b.output_token_ids), b.num_tokens)
    # Resume: recompute prompt+outputs; the next logits are at position num_tokens.
    while b.num_tokens == victim_state[1]:
        out = h.step()
    assert b.output_token_ids[: len(victim_state[0])] == victim_state[0]
    h.drain()
    assert h.done[b.seq_id] == reference([4, 5, 6], 8)


@pytest.mark.parametrize("abort_at", range(0, 12))
@pytest.mark.parametrize("mid_step", [False, True])
def test_l7_abort_at_any_point_frees_exactly_once(abort_at: int, mid_step: bool) -> None:
    h = Harness(num_blocks=8, block_size=2, long_prefill_chunk=3)
    seqs = [h.add([1, 2, 3, 4, 5], 4), h.add([1, 2, 3, 4, 6], 4), h.add([3, 3], 4)]
    target = seqs[abort_at % 3]
    for _ in range(abort_at // 3 + 1):
        h.step()
    if mid_step:  # NOTE: abort between schedule() and on_step_done (a cancel during forward)
        out = h.sched.schedule()
        for c in out.chunks:
            h.kv.write(c.seq, c.start_pos, c.token_ids)
        got = h.sched.abort(target.seq_id)
        h.sched.on_step_done(out)
        for c in out.chunks:
            if c.need_logits and c.seq.status is SequenceStatus.RUNNING:
                h.select(c.seq, next_token(h.kv.read(c.seq, c.seq.num_computed_tokens)))
    else:
        got = h.sched.abort(target.seq_id)
    h.bm.check_integrity()
    assert (got is target) == (target.seq_id not in h.done)
    assert target.status is SequenceStatus.FINISHED and not h.bm.is_allocated(target)
    assert h.sched.abort(target.seq_id) is None
    with pytest.raises(ValueError):
        h.sched.finish(target)
    h.drain()


def test_l7_finish_twice_raises() -> None:
    h = Harness(num_blocks=8)
    seq = h.add([1, 2], 3)
    h.step()
    h.sched.finish(seq)
    with pytest.raises(ValueError):
        h.sched.finish(seq)
    h.bm.check_integrity()
    assert h.bm.num_free_blocks == 8


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.lists(st.integers(0, 2), min_size=1, max_size=9), st.integers(1, 6)
        ),
        st.tuples(st.just("abort"), st.just([]), st.integers(0, 20)),  # (op, _, seq_id)
        st.tuples(st.just("step"), st.just([]), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=120, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(5, 12),
    caching=st.booleans(),
    chunk=st.integers(1, 5),
    budget=st.integers(3, 12),
)
def test_t4_l7_random_operations(
    ops: list[tuple[str, list[int], int]], num_blocks: int, caching: bool, chunk: int, budget: int
) -> None:
    """Random add/abort/step: integrity always holds, outputs match, all blocks come back."""
    h = Harness(
        num_blocks,
        2,
        enable_prefix_caching=caching,
        long_prefill_chunk=chunk,
        max_num_batched_tokens=budget,
        max_num_seqs=3,
    )
    added: dict[int, tuple[list[int], int]] = {}
    aborted: set[int] = set()
    for op, prompt, max_out in ops:
        if op == "add":
            if -(-(len(prompt) + max_out) // 2) > num_blocks:
                continue
            added[h.add(prompt, max_out).seq_id] = (prompt, max_out)
        elif op == "abort":
            if h.sched.abort(max_out) is not None:  # NOTE: here max_out carries the seq id
                aborted.add(max_out)
        else:
            h.step()
        h.bm.check_integrity()
    h.drain()
    assert set(h.done) | aborted == set(added)
    for seq_id, out in h.done.items():
        assert out == reference(*added[seq_id])


@settings(max_examples=examples(60), deadline=None)
@given(prompts=st.lists(st.integers(1, 40), min_size=1, max_size=6),
       scoring=st.lists(st.booleans(), min_size=6, max_size=6),
       scoring_rows=st.integers(1, 16), chunk=st.integers(1, 16),
       budget=st.integers(6, 48))
def test_o1_scoring_rows_per_step_are_bounded_for_all_mixes(
        prompts: list[int], scoring: list[bool], scoring_rows: int, chunk: int,
        budget: int) -> None:
    """O1, echo: sequences scoring their prompt keep every row's logits (a vocabulary each),
    so between them they compute at most ``scoring_rows`` positions per step, however many
    there are and whatever else runs; everything still completes, each output the reference."""
    h = Harness(num_blocks=256, block_size=4, scoring_rows=scoring_rows,
                long_prefill_chunk=chunk, max_num_batched_tokens=budget)
    seqs = []
    for n, (length, scores) in enumerate(zip(prompts, scoring, strict=False)):
        seqs.append(h.add([(n * 7 + i) % VOCAB + 1 for i in range(length)], 2))
        if scores:
            h.fresh.add(seqs[-1].seq_id)
    for _ in range(2000):
        if not h.sched.has_work:
            break
        out = h.step()
        assert sum(c.num_tokens for c in out.chunks if c.seq.seq_id in h.fresh) <= scoring_rows
        assert all(c.num_tokens > 0 for c in out.chunks)  # NOTE: nothing admitted to idle
    h.drain()
    assert h.done == {s.seq_id: reference(s.prompt_token_ids, 2) for s in seqs}
