"""The block manager's bookkeeping invariants, checked (issue 11 item 5; SPEC T3, L7).

:meth:`coda.engine.kv_cache.BlockManager.check_integrity` runs :func:`check_integrity`: every
block in exactly one state (free, evictable, in use; the table in :mod:`coda.engine.kv_cache`),
reference counts equal to the block tables holding each block, every cached block's tokens and
hash mapping back to it, every block a sequence may still write private to it (T3, L7), and
nothing in use or cached past the touched high-water mark. The engine runs it each time it goes
idle (``engine_thread.check_when_idle``), never on a request's path; the tests after every
operation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coda.engine.kv_cache import KVCacheError

if TYPE_CHECKING:
    from coda.engine.kv_cache import BlockManager

__all__ = ["check_integrity"]


def check_integrity(bm: BlockManager) -> None:
    """Raise :class:`KVCacheError` unless every bookkeeping invariant holds."""
    refs = [0] * bm.num_blocks
    for seq_id, seq in bm._owners.items():
        table = seq.block_table
        _require(seq.seq_id == seq_id, "owner keyed by wrong seq id")
        _require(len(set(table)) == len(table), f"seq {seq_id}: block twice in table")
        _require(
            len(table) * bm.block_size >= seq.num_computed_tokens,
            f"seq {seq_id}: computed tokens beyond its blocks",
        )
        for i, block_id in enumerate(table):
            refs[block_id] += 1
            block = bm._blocks[block_id]
            if block.hash is not None:
                lo = i * bm.block_size
                _require(
                    block.tokens == tuple(seq.all_token_ids[lo : lo + bm.block_size]),
                    f"seq {seq_id}: cached block {block_id} holds other tokens",
                )
        # NOTE: T3/L7 — every block still to be written is private to this sequence.
        for block_id in table[seq.num_computed_tokens // bm.block_size :]:
            _require(
                refs[block_id] == 1 and bm._blocks[block_id].ref_count == 1,
                f"seq {seq_id}: writable block {block_id} is shared",
            )
    free_set, evict_set = set(bm._free), set(bm._evictable)
    _require(len(free_set) == len(bm._free), "block twice in free list")
    _require(not free_set & evict_set, "block in both free lists")
    used = 0
    for block in bm._blocks:
        _require(
            block.ref_count == refs[block.block_id],
            f"block {block.block_id}: ref_count {block.ref_count} != {refs[block.block_id]}",
        )
        in_free = block.block_id in free_set or block.block_id in evict_set
        _require(in_free == (block.ref_count == 0), f"block {block.block_id}: free-list state")
        _require(
            (block.block_id in evict_set) <= (block.hash is not None),
            f"block {block.block_id}: evictable but not hashed",
        )
        _require(
            (block.block_id in free_set) <= (block.hash is None),
            f"block {block.block_id}: free but still hashed",
        )
        if block.hash is not None:
            _require(
                bm._cached.get(block.hash) == block.block_id,
                f"block {block.block_id}: hash does not map back",
            )
        used += block.ref_count > 0
    _require(used + bm.num_free_blocks == bm.num_blocks, "free + used != total")
    _require(all(b.ref_count == 0 and b.hash is None for b in bm._blocks[bm._touched:]),
             "a block past the touched high-water mark is in use or cached")
    for h, block_id in bm._cached.items():
        _require(bm._blocks[block_id].hash == h, f"cache entry for {block_id} is stale")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise KVCacheError(message)
