"""Block manager: accounting, exactly-once free, prefix caching, eviction, collisions (T3, L7)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from coda.engine import kv_cache
from coda.engine.kv_cache import (
    BlockManager,
    KVCacheError,
    kv_bytes_per_token,
    slot_mapping,
)
from coda.engine.sequence import Sequence, SequenceStatus


class FakeKV:
    """Physical slot store standing in for the KV tensors: slot -> (token, position).

    ``write`` refuses to touch a shared block (T3/L7); ``read`` returns the tokens whose K/V a
    sequence's block table really points at, so a wrong prefix-cache hit changes the result.
    """

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[int, tuple[int, int]] = {}

    def write(self, seq: Sequence, start: int, tokens: tuple[int, ...] | list[int]) -> None:
        bs = self.bm.block_size
        for slot, pos, tok in zip(
            slot_mapping(seq.block_table, bs, start, len(tokens)),
            range(start, start + len(tokens)),
            tokens,
            strict=True,
        ):
            assert self.bm.ref_count(slot // bs) == 1, "write into a shared block"
            self.slots[slot] = (tok, pos)

    def read(self, seq: Sequence, n: int) -> list[int]:
        slots = slot_mapping(seq.block_table, self.bm.block_size, 0, n)
        got = [self.slots.get(s, (-1, -1)) for s in slots]
        assert [p for _, p in got] == list(range(n)), "K/V at wrong positions"
        tokens = [t for t, _ in got]
        assert tokens == seq.all_token_ids[:n], "cache serves K/V of other tokens"
        return tokens


def make_seq(seq_id: int, prompt: list[int], max_total: int | None = None) -> Sequence:
    seq = Sequence(seq_id, list(prompt), max_total or len(prompt) + 16)
    seq.status = SequenceStatus.RUNNING  # NOTE: bookkeeping tests drive the manager directly
    return seq


def compute(bm: BlockManager, kv: FakeKV, seq: Sequence, n: int) -> None:
    """What scheduler + model do for ``n`` tokens: grow, write K/V, mark computed, cache."""
    bm.append(seq, n)
    kv.write(seq, seq.num_computed_tokens, seq.all_token_ids[seq.num_computed_tokens :][:n])
    seq.num_computed_tokens += n
    bm.cache_computed_blocks(seq)
    bm.check_integrity()


def test_l7_allocate_append_free_accounting() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    kv = FakeKV(bm)
    seq = make_seq(1, list(range(6)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    bm.check_integrity()
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    assert seq.num_computed_tokens == 0 and bm.usage == pytest.approx(2 / 8)
    compute(bm, kv, seq, 6)
    seq.append_token(100)
    compute(bm, kv, seq, 1)  # position 6 fits block 1
    assert len(seq.block_table) == 2
    seq.append_token(101)
    compute(bm, kv, seq, 1)
    seq.append_token(102)
    assert bm.can_append(seq, 1)
    compute(bm, kv, seq, 1)  # position 8 needs block 2
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert kv.read(seq, 9) == seq.all_token_ids
    bm.free(seq)
    bm.check_integrity()
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0


def test_l7_double_free_raises_and_allocate_is_exact() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(1, list(range(5)))
    bm.allocate(seq)
    with pytest.raises(KVCacheError):
        bm.allocate(seq)
    bm.free(seq)
    with pytest.raises(KVCacheError):
        bm.free(seq)
    bm.check_integrity()
    big = make_seq(2, list(range(9)))  # needs 3 blocks of 2
    assert not bm.can_allocate(big)
    with pytest.raises(KVCacheError):
        bm.allocate(big)
    bm.check_integrity()
    assert bm.num_free_blocks == 2


def test_can_append_is_exact_when_full() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    seq = make_seq(1, [1, 2, 3, 4])
    bm.allocate(seq)
    seq.num_computed_tokens = 4
    assert not bm.can_append(seq, 1)
    with pytest.raises(KVCacheError):
        bm.append(seq, 1)
    assert bm.can_append(seq, 0)
    bm.free(seq)
    bm.check_integrity()


def test_t3_prefix_hit_shares_full_blocks_with_refcounts() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    kv = FakeKV(bm)
    a = make_seq(1, list(range(10)))
    bm.allocate(a)
    compute(bm, kv, a, 10)
    assert bm.num_cached_blocks == 2  # the partial third block is never cached
    b = make_seq(2, [*range(8), 50, 51, 52])
    bm.allocate(b)
    bm.check_integrity()
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert b.num_computed_tokens == 8
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 1]
    compute(bm, kv, b, 3)
    assert kv.read(b, 11) == b.all_token_ids
    bm.free(a)
    bm.check_integrity()
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1]
    bm.free(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2


def test_t3_a_hit_request_registers_the_blocks_it_computes_after_the_hit() -> None:
    """The registration cursor starts after the hit blocks (they are registered already), so
    a request that reused a prefix still caches the full blocks it computes itself, for the
    next request with the longer prefix."""
    bm = BlockManager(num_blocks=16, block_size=4)
    kv = FakeKV(bm)
    a = make_seq(1, list(range(8)))
    bm.allocate(a)
    compute(bm, kv, a, 8)
    b = make_seq(2, [*range(8), *range(20, 29)])  # hits a's 2 blocks, computes 2 more full
    bm.allocate(b)
    assert b.num_computed_tokens == 8
    compute(bm, kv, b, 9)
    assert bm.num_cached_blocks == 4
    c = make_seq(3, [*range(8), *range(20, 29), 99])
    bm.allocate(c)
    assert c.num_computed_tokens == 16 and c.block_table[:4] == b.block_table[:4]


def test_t1_full_prompt_hit_still_leaves_last_token_to_compute() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    kv = FakeKV(bm)
    a = make_seq(1, list(range(8)))
    bm.allocate(a)
    compute(bm, kv, a, 8)
    b = make_seq(2, list(range(8)))
    bm.allocate(b)
    bm.check_integrity()
    # NOTE: only one block is shared; the block holding the last prompt token is private.
    assert b.num_computed_tokens == 4 and b.num_uncomputed_tokens == 4
    assert b.block_table[0] == a.block_table[0] and b.block_table[1] != a.block_table[1]
    compute(bm, kv, b, 4)
    assert kv.read(b, 8) == b.all_token_ids
    bm.free(a)
    bm.free(b)
    bm.check_integrity()


def test_prefix_hit_counts_live_shared_blocks_as_free() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    kv = FakeKV(bm)
    a = make_seq(1, list(range(9)))
    bm.allocate(a)
    compute(bm, kv, a, 9)
    b = make_seq(2, [*range(8), 77])  # 3 blocks, 2 of them live in a
    assert bm.num_free_blocks == 1 and bm.can_allocate(b)
    bm.allocate(b)
    bm.check_integrity()
    assert bm.num_free_blocks == 0 and b.num_computed_tokens == 8
    bm.free(b)
    bm.free(a)
    bm.check_integrity()


def test_evictable_blocks_are_reused_lru_when_memory_is_needed() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    kv = FakeKV(bm)
    a = make_seq(1, list(range(9)))
    bm.allocate(a)
    compute(bm, kv, a, 9)
    a_blocks = list(a.block_table)
    bm.free(a)
    bm.check_integrity()
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    # Needs 3 blocks: 2 never-cached ones, then evicts the chain's TAIL (a's block 1) first.
    c = make_seq(2, [90 + i for i in range(12)])
    bm.allocate(c)
    bm.check_integrity()
    assert a_blocks[1] in c.block_table and a_blocks[0] not in c.block_table
    assert bm.num_cached_blocks == 1
    compute(bm, kv, c, 12)
    bm.free(c)
    d = make_seq(3, list(range(9)))  # a's first block is still a verified hit
    bm.allocate(d)
    assert d.block_table[0] == a_blocks[0] and d.num_computed_tokens == 4
    compute(bm, kv, d, 5)
    assert kv.read(d, 9) == d.all_token_ids
    bm.free(d)
    bm.check_integrity()


def test_t3_hash_collision_never_serves_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """Force collisions: a hash that ignores the parent, then one that is constant."""
    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, tokens: hash(tokens))
    bm = BlockManager(num_blocks=16, block_size=2)
    kv = FakeKV(bm)
    x, y, z = [1, 2], [3, 4], [5, 6]
    a = make_seq(1, [*x, *y, 9])
    bm.allocate(a)
    compute(bm, kv, a, 5)  # caches X and Y-after-X
    c = make_seq(2, [*z, *y, 9])
    bm.allocate(c)
    assert c.num_computed_tokens == 0  # Z is not cached yet
    compute(bm, kv, c, 5)  # caches Z; Y-after-Z collides with Y-after-X and stays private
    d = make_seq(3, [*z, *y, 8])
    bm.allocate(d)
    bm.check_integrity()
    # NOTE: same tokens, colliding key, but a different parent: only Z may be reused.
    assert d.num_computed_tokens == 2 and d.block_table[0] == c.block_table[0]
    compute(bm, kv, d, 3)
    assert kv.read(d, 5) == d.all_token_ids
    monkeypatch.setattr(kv_cache, "block_hash", lambda parent, tokens: 0)
    e = make_seq(4, [7, 7, *x, 1])
    bm.allocate(e)
    assert e.num_computed_tokens == 0  # key 0 maps to a block with other tokens
    compute(bm, kv, e, 5)
    for s in (a, c, d, e):
        bm.free(s)
    bm.check_integrity()
    assert bm.num_free_blocks == 16


def test_prefix_caching_disabled_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    kv = FakeKV(bm)
    a = make_seq(1, [1, 2, 3, 4, 5])
    bm.allocate(a)
    compute(bm, kv, a, 5)
    b = make_seq(2, [1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)
    assert bm.num_cached_blocks == 0
    bm.free(a)
    bm.free(b)
    bm.check_integrity()


def test_check_integrity_detects_corruption() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    kv = FakeKV(bm)
    a = make_seq(1, [1, 2, 3])
    bm.allocate(a)
    compute(bm, kv, a, 3)
    bm.check_integrity()
    bm._blocks[a.block_table[0]].ref_count += 1  # a leaked reference
    with pytest.raises(KVCacheError, match="ref_count"):
        bm.check_integrity()
    bm._blocks[a.block_table[0]].ref_count -= 1
    bm._free.append(bm._free[0])  # the same block twice in the free list
    with pytest.raises(KVCacheError):
        bm.check_integrity()
    bm._free.pop()
    a.block_table.append(a.block_table[0])  # shared block where the sequence will write
    with pytest.raises(KVCacheError):
        bm.check_integrity()


def test_t3_kv_memory_per_token_and_slots() -> None:
    # 2 layers, 2 KV heads, head dim 4, bf16: 2*2*2*4*2 bytes per token.
    assert kv_bytes_per_token(2, 2, 4, 2) == 64
    assert slot_mapping([3, 0], 4, 2, 4) == [14, 15, 0, 1]


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / select / free; integrity and content after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=6, block_size=2)
        self.kv = FakeKV(self.bm)
        self.live: list[Sequence] = []
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=7))
    def allocate(self, prompt: list[int]) -> None:
        seq = make_seq(self.next_id, prompt, max_total=12)
        self.next_id += 1
        if self.bm.can_allocate(seq):
            self.bm.allocate(seq)
            self.live.append(seq)
        else:
            with pytest.raises(KVCacheError):
                self.bm.allocate(seq)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def compute_or_select(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        if seq.num_uncomputed_tokens == 0:
            if seq.num_tokens < seq.max_total_tokens:
                seq.append_token(data.draw(st.integers(0, 1)))
            return
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens))
        if self.bm.can_append(seq, n):
            compute(self.bm, self.kv, seq, n)
            self.kv.read(seq, seq.num_computed_tokens)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        with pytest.raises(KVCacheError):
            self.bm.free(seq)

    @invariant()
    def integrity(self) -> None:
        self.bm.check_integrity()

    def teardown(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        self.bm.check_integrity()
        assert self.bm.num_free_blocks == self.bm.num_blocks and self.bm.usage == 0.0


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_l7_block_manager_state_machine = BlockManagerMachine.TestCase
