"""Paged KV-cache block manager with prefix caching (SPEC T3, T4, L7). Pure bookkeeping.

Physical KV memory is split into ``num_blocks`` blocks of ``block_size`` token slots. A
sequence's ``block_table[i]`` holds its logical positions ``[i*bs, (i+1)*bs)``. Every block
is in exactly one state::

    state        ref_count  hashed  where
    free         0          no      _free (a heap: the lowest id is taken first)
    evictable    0          yes     _evictable (LRU; reused only when _free is empty)
    in use       >= 1       either  some block tables

Prefix caching: a FULL block whose tokens are all computed is registered under a chained
hash ``block_hash(parent_hash, tokens)``. A hit must also match the block's tokens and its
parent's registration id, so a hash collision can never serve wrong K/V. Only full,
computed blocks are ever shared, and a sequence only writes at positions
``>= num_computed_tokens``, which lie in blocks it owns alone (T3, L7).

KV memory per token is ``2·L·H_kv·d_h·dtype_bytes`` (T3); a sequence wastes at most one
partial block. Free blocks are taken lowest id first, so the blocks ever written are always
``[0, num_touched_blocks)``: the cache's memory is committed on first write (issue 19 item 3),
and its committed part is that prefix of each K/V plane, a high-water mark of blocks in use or
cached, never the whole reservation because blocks cycled through a FIFO.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from coda.engine.sequence import Sequence


class KVCacheError(RuntimeError):
    """A block-manager contract was broken (double free, overdraft, integrity violation)."""


def block_hash(parent_hash: int | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of one full block. Collisions are tolerated (hits are verified)."""
    return hash((parent_hash, tokens))


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Logical cache growth per processed token: 2·L·H_kv·d_h scalars (T3)."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks covering ``num_tokens`` positions (ceil division)."""
    return -(-num_tokens // block_size)


def slot_mapping(block_table: list[int], block_size: int, start: int, count: int) -> list[int]:
    """Physical slot (block_id*bs + offset) of logical positions ``start .. start+count-1``."""
    return [
        block_table[p // block_size] * block_size + p % block_size
        for p in range(start, start + count)
    ]


@dataclass
class _Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] | None = None
    reg: int = 0  # NOTE: unique registration id while hashed; 0 = not registered
    parent_reg: int = 0  # registration id of the block before it (0 = first block)


class BlockManager:
    """Allocates KV blocks to sequences; verbs are paired: ``can_X`` is true iff ``X`` succeeds.

    Contract (L7): ``allocate`` once, then any number of ``append``, then ``free`` exactly
    once (a second ``free`` raises); after ``free`` the sequence may be allocated again
    (recompute after preemption, T4).
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: list[int] = list(range(num_blocks))  # NOTE: a heap (sorted is one)
        self._touched = 0  # NOTE: 1 + the highest block id ever taken
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._owners: dict[int, Sequence] = {}  # seq_id -> the allocated sequence
        self._next_reg = 1

    # ----- queries -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: never used plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (for metrics)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_touched_blocks(self) -> int:
        """Blocks ever handed out: ``[0, num_touched_blocks)`` (lowest id first), whose KV
        memory is committed; the rest of the reservation was never written."""
        return self._touched

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        """How many live block tables hold ``block_id`` (> 1 only for full cached blocks)."""
        return self._blocks[block_id].ref_count

    def is_allocated(self, seq: Sequence) -> bool:
        return seq.seq_id in self._owners

    def _match_prefix(self, tokens: list[int]) -> list[_Block]:
        """Longest verified chain of cached full blocks that prefixes ``tokens``."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        matched: list[_Block] = []
        parent_hash: int | None = None
        parent_reg = 0
        for i in range(len(tokens) // bs):
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent_hash, chunk)
            block_id = self._cached.get(h)
            if block_id is None:
                break
            block = self._blocks[block_id]
            # NOTE: collision safety — same tokens AND the very parent we matched.
            if block.tokens != chunk or block.parent_reg != parent_reg:
                break
            matched.append(block)
            parent_hash, parent_reg = h, block.reg
        if matched and len(matched) * bs >= len(tokens):
            # NOTE: leave at least the last token to compute so the engine gets logits; it is
            # written into a fresh private block, never into the shared one.
            matched.pop()
        return matched

    # ----- allocate / append / free --------------------------------------------------
    def can_allocate(self, seq: Sequence, reuse: bool = True) -> bool:
        """Whether :meth:`allocate` would succeed now."""
        if self.is_allocated(seq):
            return False
        hits = self._match_prefix(seq.all_token_ids) if reuse else []
        shared_live = sum(1 for b in hits if b.ref_count > 0)  # cost no free block
        return blocks_needed(seq.num_tokens, self.block_size) - shared_live <= self.num_free_blocks

    def allocate(self, seq: Sequence, reuse: bool = True) -> None:
        """Give ``seq`` blocks for all its known tokens, reusing cached full blocks (unless
        ``reuse`` is False: a request that scores its prompt computes every position).

        A hit sets ``seq.num_computed_tokens`` to the cached length (always < num_tokens).
        """
        if self.is_allocated(seq) or seq.block_table:
            raise KVCacheError(f"seq {seq.seq_id} is already allocated")
        if seq.num_computed_tokens != 0:
            raise KVCacheError(f"seq {seq.seq_id}: allocate with computed tokens")
        if not self.can_allocate(seq, reuse):
            raise KVCacheError(f"seq {seq.seq_id}: not enough free blocks")
        hits = self._match_prefix(seq.all_token_ids) if reuse else []
        for block in hits:
            if block.ref_count == 0:
                del self._evictable[block.block_id]
            block.ref_count += 1
        table = [b.block_id for b in hits]
        for _ in range(blocks_needed(seq.num_tokens, self.block_size) - len(hits)):
            table.append(self._take_block())
        seq.block_table = table
        seq.num_computed_tokens = len(hits) * self.block_size
        # NOTE: the registration cursor lives on the sequence (issue 22: no owner record)
        seq.hashed_blocks, seq.hash_chain_ok = len(hits), True
        self._owners[seq.seq_id] = seq

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether blocks can cover ``num_computed_tokens + num_new_tokens`` positions."""
        return self._extra_blocks(seq, num_new_tokens) <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover ``num_computed_tokens + num_new_tokens`` positions."""
        extra = self._extra_blocks(seq, num_new_tokens)
        if extra > self.num_free_blocks:
            raise KVCacheError(f"seq {seq.seq_id}: not enough free blocks to append")
        for _ in range(extra):
            seq.block_table.append(self._take_block())

    def _extra_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        if not self.is_allocated(seq):
            raise KVCacheError(f"seq {seq.seq_id} is not allocated")
        need = blocks_needed(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, need - len(seq.block_table))

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks (exactly once, L7). Hashed blocks stay reusable (LRU)."""
        if self._owners.pop(seq.seq_id, None) is None:
            raise KVCacheError(f"seq {seq.seq_id}: free of an unallocated sequence")
        # NOTE: reverse order so a chain's tail is evicted before its (more shared) head.
        for block_id in reversed(seq.block_table):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._evictable[block_id] = None
                else:
                    heapq.heappush(self._free, block_id)
        seq.block_table = []

    def truncate(self, seq: Sequence) -> None:
        """Return the blocks past ``seq.num_computed_tokens`` (issue 21: a verification's
        rejected drafts). They are private and never registered (only full computed blocks
        are), so each goes back to the free heap."""
        if not self.is_allocated(seq):
            raise KVCacheError(f"seq {seq.seq_id} is not allocated")
        keep = blocks_needed(seq.num_computed_tokens, self.block_size)
        while len(seq.block_table) > keep:
            block = self._blocks[seq.block_table.pop()]
            if block.ref_count != 1 or block.hash is not None:
                raise KVCacheError(f"seq {seq.seq_id}: truncating shared block {block.block_id}")
            block.ref_count = 0
            heapq.heappush(self._free, block.block_id)

    def _take_block(self) -> int:
        if self._free:
            block_id = heapq.heappop(self._free)
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently freed
            block = self._blocks[block_id]
            assert block.hash is not None
            del self._cached[block.hash]
            block.hash, block.tokens, block.reg, block.parent_reg = None, None, 0, 0
        self._blocks[block_id].ref_count = 1
        self._touched = max(self._touched, block_id + 1)
        return block_id

    # ----- prefix-cache registration -------------------------------------------------
    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register ``seq``'s full, computed blocks for reuse (call after each step)."""
        if (not self.is_allocated(seq) or not self.enable_prefix_caching
                or not seq.hash_chain_ok):
            return
        bs = self.block_size
        tokens = seq.all_token_ids
        for i in range(seq.hashed_blocks, seq.num_computed_tokens // bs):
            seq.hashed_blocks = i + 1
            block = self._blocks[seq.block_table[i]]
            parent = self._blocks[seq.block_table[i - 1]] if i > 0 else None
            if parent is not None and parent.hash is None:
                seq.hash_chain_ok = False  # NOTE: unreachable by verified lookup; stop here
                return
            chunk = tuple(tokens[i * bs : (i + 1) * bs])
            h = block_hash(parent.hash if parent else None, chunk)
            if h in self._cached:
                # NOTE: same content computed twice, or a collision: keep ours private.
                seq.hash_chain_ok = False
                return
            block.hash, block.tokens = h, chunk
            block.reg, block.parent_reg = self._next_reg, parent.reg if parent else 0
            self._next_reg += 1
            self._cached[h] = block.block_id

    # ----- integrity -------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise :class:`KVCacheError` unless every bookkeeping invariant holds (the checks:
        :mod:`coda.engine.kv_integrity`)."""
        from coda.engine.kv_integrity import check_integrity

        check_integrity(self)
