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
says so at load). Pure Python (no torch).
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


@dataclass(frozen=True)
class KVBudget:
    """The chosen cache size (bytes reserved) and why."""

    num_bytes: int
    reason: str  # "--kv-cache-bytes" | "8 full contexts (under --memory-budget 2GiB …)" …


def kv_cache_budget(*, bytes_per_token: int, block_size: int, context: int, max_num_seqs: int,
                    kv_cache_bytes: int | None, memory_fraction: float | None,
                    available: int | None = None, memory_budget: MemoryBudget | None = None,
                    weights_bytes: int = 0) -> KVBudget:
    """Bytes for the KV cache (see the module docstring). ``available`` is read now when
    None (used by ``memory_fraction`` and by the default budget)."""
    block = bytes_per_token * block_size
    if kv_cache_bytes is not None:
        if kv_cache_bytes < block:
            raise ValueError(f"kv_cache_bytes ({kv_cache_bytes}) is smaller than one block "
                             f"({block} bytes)")
        return KVBudget(kv_cache_bytes, "--kv-cache-bytes")
    need = max_num_seqs * -(-context // block_size) * block
    if memory_fraction is not None:
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"kv cache memory fraction must be in (0, 1], got {memory_fraction}")
        free = available_memory_bytes() if available is None else available
        budget = max(block, min(need, int(memory_fraction * free)))
        why = f"{memory_fraction:g} of {free / 2**30:.1f} GiB available"
        if budget == need:
            why = f"{max_num_seqs} full contexts (under {why})"
        return KVBudget(budget, why)
    mb = memory_budget or MemoryBudget.default(available)
    room = mb.num_bytes - weights_bytes
    if room < block:
        raise MemoryBudgetError(
            f"memory budget {_gib(mb.num_bytes)} ({mb.origin}) leaves {_gib(max(0, room))} "
            f"after the weights ({_gib(weights_bytes)}): not one KV block ({block} bytes); "
            "raise --memory-budget")
    if need <= room:
        return KVBudget(need, f"{max_num_seqs} full contexts, under a memory budget of "
                              f"{_gib(mb.num_bytes)} ({mb.origin})")
    return KVBudget(room, f"memory budget {_gib(mb.num_bytes)} ({mb.origin}) less "
                          f"{_gib(weights_bytes)} of weights")


def kv_capacity(num_blocks: int, block_size: int, context: int) -> str:
    """The load summary's KV capacity: tokens, then how many full contexts they hold. A
    sequence takes whole blocks, so a context that is no multiple of the block holds fewer
    sequences than ``tokens // context`` (a 4-token context in 16-token blocks: one block each;
    it read "4 full contexts", then "16 sequences x 4 context")."""
    per_seq = -(-context // block_size)
    whole = f" (a sequence takes whole blocks: {per_seq} each)" if context % block_size else ""
    return (f"{num_blocks * block_size} tokens in blocks of {block_size}: "
            f"{num_blocks // per_seq} sequences x {context} context{whole}")
