"""How big the KV cache is, decided once at load (issue 9 item 4, issue 19 item 3; SPEC T3).

One knob, the **memory budget**: the bytes a model may hold, its weights plus its KV cache
(``--memory-budget``; the several-models server gives each model such a budget, its share of
the server's). The cache reserves ``min(max_num_seqs full contexts, budget - weights)``; it is
mapped, not committed: pages are committed as blocks are first written (``PagedKVCache``), so
a small model's process starts with the weights' RSS, not the whole reservation's.

Precedence: ``kv_cache_bytes`` (exact) > ``kv_cache_memory_fraction`` (of the memory available
after the weights, capped at ``max_num_seqs`` full contexts; kept for compatibility) > the
memory budget (given, else :data:`DEFAULT_MEMORY_FRACTION` of the memory available when the
load started). A budget whose room after the weights is below one block is refused at start
(:class:`MemoryBudgetError`); one below one full context lowers the served context (the engine
says so at load). A draft model (``--draft-model``, issue 21) is inside the budget too: its
weights and its own cache (:class:`DraftShare`; as many blocks as the target's, plus
:data:`DRAFT_SPARE_BLOCKS`) come out of the budget before the target's cache is sized, and a
budget that cannot hold one block of each is refused naming both models' shares. Pure Python
(no torch).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from fractions import Fraction

DEFAULT_MEMORY_FRACTION = 0.5  # NOTE: of MemAvailable at start: weights + KV, room for the rest
# NOTE: the fraction a worker of the several-models server takes of its model's KV share
# (coda/engine/process_worker.py, coda/server/model_slot.py's estimate)
DEFAULT_KV_MEMORY_FRACTION = 0.25

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


class MemoryBudgetError(ValueError):
    """A memory budget that cannot be parsed, or that leaves no room for one KV block."""


def available_memory_bytes() -> int:
    """``MemAvailable`` from /proc/meminfo; else half the physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def rss_bytes() -> int:
    """This process's resident set size (bytes), from /proc/self/statm; 0 where absent."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _size(n: int) -> str:
    """GiB, or MiB below one (a small draft's share reads 0.00 GiB)."""
    return _gib(n) if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes one model may hold in memory: its weights plus its KV cache; ``origin`` says
    where the figure came from (for the load summary)."""

    num_bytes: int
    origin: str

    @classmethod
    def parse(cls, text: str, available: int | None = None) -> MemoryBudget:
        """``"8GiB"``, ``"8G"`` (10^9), ``"512MiB"``, ``"1000000"`` (bytes) or ``"40%"`` (of
        the memory available now). Raises :class:`MemoryBudgetError` on anything else."""
        s = text.strip().lower().replace(" ", "")
        if s.endswith("%"):
            try:
                pct = float(s[:-1])
            except ValueError:
                raise MemoryBudgetError(f"memory budget {text!r}: not a percentage") from None
            if not 0 < pct <= 100:
                raise MemoryBudgetError(f"memory budget {text!r}: a percentage in (0, 100]")
            free = available_memory_bytes() if available is None else available
            return cls(int(free * pct / 100), f"{pct:g}% of {_gib(free)} available")
        m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]*)", s)
        if m is None or m.group(2) not in _UNITS:
            raise MemoryBudgetError(f"memory budget {text!r}: use bytes or a size such as "
                                    "8GiB, 8G, 512MiB or 40%")
        # NOTE: exact (a float product drifts past 2**53: 36893489t read 4096 bytes short)
        n = int(Fraction(m.group(1)) * _UNITS[m.group(2)])
        if n <= 0:
            raise MemoryBudgetError(f"memory budget {text!r} must be positive")
        return cls(n, f"--memory-budget {text.strip()}")

    @classmethod
    def default(cls, available: int | None = None) -> MemoryBudget:
        """:data:`DEFAULT_MEMORY_FRACTION` of the memory available now (call before loading)."""
        free = available_memory_bytes() if available is None else available
        return cls(int(DEFAULT_MEMORY_FRACTION * free),
                   f"default {DEFAULT_MEMORY_FRACTION:g} of {_gib(free)} available at start")


# NOTE: a draft model's cache holds the target's blocks plus these: room for a full batch's
# drafts past the target's tokens (coda/engine/draft_load.py builds it)
DRAFT_SPARE_BLOCKS = 8


@dataclass(frozen=True)
class DraftShare:
    """What a draft model (``--draft-model``, issue 21) adds to what a budget covers: its
    weights, and a KV cache of the target's blocks plus :data:`DRAFT_SPARE_BLOCKS`, at the
    draft's own bytes per token (blocks of the target's size)."""

    weights_bytes: int
    bytes_per_token: int


@dataclass(frozen=True)
class KVBudget:
    """The chosen cache size (bytes reserved) and why; with a draft model, the draft's cache
    (``draft_bytes``, 0 without one); ``budget`` is the memory budget that sized them (None
    where an exact size or a fraction did)."""

    num_bytes: int
    reason: str  # "--kv-cache-bytes" | "8 full contexts (under --memory-budget 2GiB …)" …
    draft_bytes: int = 0
    budget: MemoryBudget | None = None


def kv_cache_budget(*, bytes_per_token: int, block_size: int, context: int, max_num_seqs: int,
                    kv_cache_bytes: int | None, memory_fraction: float | None,
                    available: int | None = None, memory_budget: MemoryBudget | None = None,
                    weights_bytes: int = 0, draft: DraftShare | None = None) -> KVBudget:
    """Bytes for the KV cache (see the module docstring). ``available`` is read now when
    None (used by ``memory_fraction`` and by the default budget). With a ``draft`` (issue 21)
    the target's cache holds ``n`` blocks and the draft's ``n + DRAFT_SPARE_BLOCKS``:
    ``kv_cache_bytes`` is the target's cache exactly (the draft's follows it, outside it); a
    fraction covers both caches; a budget covers both models' weights and both caches, ``n``
    the most that fit (at most ``max_num_seqs`` full contexts), and one that cannot hold one
    block of each is refused naming both models' shares."""
    block = bytes_per_token * block_size
    dblock = draft.bytes_per_token * block_size if draft is not None else 0

    def draft_kv(target_bytes: int) -> int:
        return (target_bytes // block + DRAFT_SPARE_BLOCKS) * dblock if draft else 0

    if kv_cache_bytes is not None:
        if kv_cache_bytes < block:
            raise ValueError(f"kv_cache_bytes ({kv_cache_bytes}) is smaller than one block "
                             f"({block} bytes)")
        why = "--kv-cache-bytes" + (" (the target's; the draft's cache holds as many tokens)"
                                    if draft else "")
        return KVBudget(kv_cache_bytes, why, draft_kv(kv_cache_bytes))
    need = max_num_seqs * -(-context // block_size) * block
    if memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"kv cache memory fraction must be in (0, 1], got {memory_fraction}")
        free = available_memory_bytes() if available is None else available
        share = int(memory_fraction * free)
        # NOTE: with a draft the fraction holds both caches: n target + n + spare draft blocks
        budget = (max(block, min(need, share)) if draft is None else
                  max(1, _target_blocks(share, need, block, dblock)) * block)
        why = f"{memory_fraction:g} of {free / 2**30:.1f} GiB available" + (
            ", with the draft's cache" if draft else "")
        if budget == need:
            why = f"{max_num_seqs} full contexts (under {why})"
        return KVBudget(budget, why, draft_kv(budget))
    mb = memory_budget or MemoryBudget.default(available)
    if draft is None:
        room = mb.num_bytes - weights_bytes
        if room < block:
            raise MemoryBudgetError(
                f"memory budget {_gib(mb.num_bytes)} ({mb.origin}) leaves {_gib(max(0, room))} "
                f"after the weights ({_gib(weights_bytes)}): not one KV block ({block} bytes); "
                "raise --memory-budget")
        if need <= room:
            return KVBudget(need, f"{max_num_seqs} full contexts, under a memory budget of "
                                  f"{_gib(mb.num_bytes)} ({mb.origin})", budget=mb)
        return KVBudget(room, f"memory budget {_gib(mb.num_bytes)} ({mb.origin}) less "
                              f"{_gib(weights_bytes)} of weights", budget=mb)
    return _with_draft(mb, need, block, dblock, weights_bytes, draft, max_num_seqs)


def _target_blocks(room: int, need: int, block: int, dblock: int) -> int:
    """The most target blocks ``n`` (at most ``need`` bytes' worth) such that ``n`` target
    blocks and ``n + DRAFT_SPARE_BLOCKS`` draft blocks fit ``room`` bytes."""
    return min(need // block, (room - DRAFT_SPARE_BLOCKS * dblock) // (block + dblock))


def _with_draft(mb: MemoryBudget, need: int, block: int, dblock: int, weights: int,
                draft: DraftShare, max_num_seqs: int) -> KVBudget:
    """Under the budget ``mb``: both models' weights, then ``n`` target blocks (``block``
    bytes each, at most ``need`` bytes) and ``n + DRAFT_SPARE_BLOCKS`` draft blocks."""
    spare = DRAFT_SPARE_BLOCKS * dblock
    least = weights + draft.weights_bytes + block + dblock + spare  # NOTE: n = 1
    if mb.num_bytes < least:
        raise MemoryBudgetError(
            f"memory budget {_size(mb.num_bytes)} ({mb.origin}) is too small for the model "
            f"and its draft (--draft-model): the model needs {_size(weights + block)} (weights "
            f"{_size(weights)} + one KV block), the draft {_size(draft.weights_bytes + dblock + spare)} "
            f"(weights {_size(draft.weights_bytes)} + its KV cache of "
            f"{1 + DRAFT_SPARE_BLOCKS} blocks): at least {least} bytes; raise --memory-budget")
    n = _target_blocks(mb.num_bytes - weights - draft.weights_bytes, need, block, dblock)
    full = n == need // block
    why = (f"{max_num_seqs} full contexts, under a memory budget of {_size(mb.num_bytes)} "
           f"({mb.origin}) with the draft's weights and cache" if full else
           f"memory budget {_size(mb.num_bytes)} ({mb.origin}) less {_size(weights)} of weights "
           f"and the draft's {_size(draft.weights_bytes)} of weights and cache")
    return KVBudget(n * block, why, (n + DRAFT_SPARE_BLOCKS) * dblock, budget=mb)


def kv_capacity(num_blocks: int, block_size: int, context: int) -> str:
    """The load summary's KV capacity: tokens, then how many full contexts they hold. A
    sequence takes whole blocks, so a context that is no multiple of the block holds fewer
    sequences than ``tokens // context`` (a 4-token context in 16-token blocks: one block each;
    it read "4 full contexts", then "16 sequences x 4 context")."""
    per_seq = -(-context // block_size)
    whole = f" (a sequence takes whole blocks: {per_seq} each)" if context % block_size else ""
    return (f"{num_blocks * block_size} tokens in blocks of {block_size}: "
            f"{num_blocks // per_seq} sequences x {context} context{whole}")
