"""How big the KV cache is, decided once at load (issue 9 item 4; SPEC T3).

Precedence: ``kv_cache_bytes`` (exact) > ``kv_cache_memory_fraction`` > the default. The
default, and the fraction, take a share of the memory **available after the weights are
loaded** (``MemAvailable``), by default :data:`DEFAULT_KV_MEMORY_FRACTION`; never more than
``max_num_seqs`` full contexts need, never less than one block. Pure Python (no torch).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_KV_MEMORY_FRACTION = 0.25  # NOTE: leaves room for activations and other processes


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


@dataclass(frozen=True)
class KVBudget:
    """The chosen cache size and why."""

    num_bytes: int
    reason: str  # "kv_cache_bytes" | "fraction 0.25 of 5.1 GiB available" …


def kv_cache_budget(*, bytes_per_token: int, block_size: int, context: int, max_num_seqs: int,
                    kv_cache_bytes: int | None, memory_fraction: float | None,
                    available: int | None = None) -> KVBudget:
    """Bytes for the KV cache (see the module docstring)."""
    block = bytes_per_token * block_size
    if kv_cache_bytes is not None:
        if kv_cache_bytes < block:
            raise ValueError(f"kv_cache_bytes ({kv_cache_bytes}) is smaller than one block "
                             f"({block} bytes)")
        return KVBudget(kv_cache_bytes, "--kv-cache-bytes")
    frac = DEFAULT_KV_MEMORY_FRACTION if memory_fraction is None else memory_fraction
    if not 0 < frac <= 1:
        raise ValueError(f"kv cache memory fraction must be in (0, 1], got {frac}")
    free = available_memory_bytes() if available is None else available
    need = max_num_seqs * -(-context // block_size) * block
    budget = max(block, min(need, int(frac * free)))
    why = f"{frac:g} of {free / 2**30:.1f} GiB available"
    if budget == need:
        why = f"{max_num_seqs} full contexts (under {why})"
    return KVBudget(budget, why)
