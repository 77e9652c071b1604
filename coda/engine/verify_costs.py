"""Prompt lookup's ``k`` priced by this engine's measured verifications (issue 21).

The row rule of :class:`~coda.engine.speculative_state.SpecState` prices a drafted row with one
constant (``step_rows``: a step's fixed cost in rows' worth, read off one machine). A row's
cost is neither one number nor a line: it depends on the CPU (a drafted row was 0.45 of a
one-row step on the AVX2 machine, 0.25 on the AVX-512 one) and on the kernels' row tiles,
whose cost is a staircase (SmolLM2 Q4_1 on AVX-512: a 4-row verification costs 1.55 one-row
steps, a 5-row one 2.0; docs/speculative.md "Measured on AVX-512").

:class:`VerifyCosts` times every batch-1 decode or verify forward on the engine's clock (on the
CPU the engine thread's CPU time: a shared machine's waits are not a row's cost) and keeps,
per number of drafted rows ``k``, an exponential average of its seconds. A ``k`` not measured
yet is priced by a decayed least-squares line through all of them
(:class:`~coda.engine.speculative_costs.DraftCosts`, the draft model's fit, with its weak prior
``row = plain / (1 + step_rows)``), so a cheap row count is tried and then known. At batch 1 a
request's ``k`` is the one with the most expected tokens per second,
``(1 + a + .. + a^k) / seconds(k)`` at its acceptance ``a``: ``k = 0`` when no ``k`` beats
plain decoding. A ``k`` measured fewer than :data:`SURE` times is priced at the lesser of its
average and the line: one forward slowed by the machine's load (a 28 ms verification of one
draft read 41 ms on the shared 2-core machine) would otherwise price that ``k`` out for good,
since a ``k`` never chosen is never measured again (free text at T = 0.8 then drafted 3 rows
where 1 paid, at 0.91x plain decoding; docs/speculative.md "Measured: honest copy
prompts"). In a crowd (several sequences in the step) the row rule stays. Choosing ``k``
never changes the output (sample-and-match keeps plain decoding's tokens whatever is drafted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from coda.engine.runner import SeqChunk
from coda.engine.speculative_costs import DraftCosts

SURE = 3  # NOTE: forwards of one k before its own average prices it alone (module docstring)
# NOTE: a k must beat the best fewer-drafts rate by more than float rounding: a tie in exact
# arithmetic (rows costing exactly what they are expected to return) goes to fewer drafts
GAIN = 1e-9


class VerifyCosts:
    """Per-engine seconds of a batch-1 forward with ``k`` drafted rows (module docstring)."""

    def __init__(self, k_max: int, step_rows: float, *,
                 clock: Callable[[], float] = time.thread_time, decay: float = 0.8) -> None:
        self.clock = clock
        self.decay = decay
        self.seconds: list[float | None] = [None] * (k_max + 1)
        self.counts = [0] * (k_max + 1)  # NOTE: forwards measured per k
        self.fit = DraftCosts(step_rows)  # NOTE: prices the k's not measured yet
        self.forwards = 0

    def timed(self, execute: Callable[[Sequence[SeqChunk]], Any],
              chunks: Sequence[SeqChunk]) -> Any:
        """The engine's forward ``execute(chunks)``, observed when it is one sequence's decode
        or verify rows (a prefill or a batch is not a verification's cost)."""
        start = self.clock()
        out = execute(chunks)
        if len(chunks) == 1 and chunks[0].need_logits and \
                len(chunks[0].token_ids) == chunks[0].num_logits:
            self.observe(chunks[0].num_logits - 1, self.clock() - start)
        return out

    def observe(self, k: int, seconds: float) -> None:
        """A batch-1 forward with ``k`` drafted rows took ``seconds``."""
        self.forwards += 1
        self.fit.observe_step(1, k, seconds)
        if k < len(self.seconds):
            self.counts[k] += 1
            old = self.seconds[k]
            self.seconds[k] = seconds if old is None else (
                self.decay * old + (1 - self.decay) * seconds)

    def price(self, k: int) -> float:
        """Seconds of a verification of ``k`` drafts: measured (:data:`SURE` times or more),
        else the fitted line, or the lesser of a few measurements' average and the line."""
        known = self.seconds[k] if k < len(self.seconds) else None
        if known is not None and self.counts[k] >= SURE:
            return known
        step = self.fit.step()
        assert step is not None  # NOTE: choose() prices only once a forward is observed
        line = step[0] + k * step[1]
        return line if known is None else min(known, line)

    def choose(self, acceptance: float, k_cap: int) -> int | None:
        """The ``k <= k_cap`` with the most expected tokens per second at per-token
        ``acceptance`` (a k only where it beats every fewer-drafts rate by more than
        :data:`GAIN`, relatively); None until two forwards, a plain one among them, are
        measured."""
        if self.forwards < 2 or self.seconds[0] is None:
            return None  # NOTE: one forward may be a first call's allocations: measure more
        best_k, best = 0, 1.0 / self.price(0)
        tokens, chance = 1.0, 1.0
        for k in range(1, min(k_cap, len(self.seconds) - 1) + 1):
            chance *= acceptance
            tokens += chance
            rate = tokens / self.price(k)
            if rate > best * (1 + GAIN):
                best_k, best = k, rate
        return best_k
