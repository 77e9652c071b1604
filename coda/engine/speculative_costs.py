"""What a draft model's drafts cost, and the ``k`` they are worth (issue 21 item 2): the
running fits :mod:`coda.engine.draft` prices each request with and
:mod:`coda.engine.verify_costs` reuses for prompt lookup's measured rows.
"""

from __future__ import annotations

from coda.engine.speculative import SpeculativeConfig


class DraftCosts:
    """Issue 21 item 2: what a draft model's drafts cost, measured on the engine's clock, and
    the ``k`` that maximizes expected tokens per second (coda.engine.draft prices each request).

    Two running estimates, each cheap (a few multiply-adds per forward):

    * the target's decode step, ``seconds = N * plain + x * row`` for ``N`` sequences and ``x``
      drafted rows: exponentially decayed least squares over the decode-only forwards, with a
      weak prior ``row = plain / (1 + step_rows)`` (the row cost docs/speculative.md measures)
      that only decides what the data leave open (no drafted row seen yet, or always the same
      ``k``);
    * the draft's forward per position and sequence (``draft``): an exponential average over
      the one-token draft forwards (a prefill or a catch-up is not a position's cost).

    With ``a`` the request's per-token acceptance, ``k`` drafts emit ``E(k) = 1 + a + .. + a^k``
    tokens for ``N * plain + k * (row + draft)`` seconds of the step; plain decoding emits
    ``N`` for ``N * plain``. :meth:`choose` returns the ``k`` with the most tokens per second,
    0 when no ``k`` beats plain decoding (a draft as dear as its target never drafts).
    """

    def __init__(self, step_rows: float = SpeculativeConfig.step_rows, decay: float = 0.9,
                 prior_weight: float = 1e-4) -> None:
        self.decay = decay
        self.ratio = 1.0 / (1.0 + step_rows)  # NOTE: prior row / plain
        self.prior_weight = prior_weight
        self._sums = [0.0] * 5  # NOTE: decayed N*N, N*x, x*x, N*y, x*y
        self.draft: float | None = None
        self.forwards = 0       # target forwards observed
        self.draft_forwards = 0

    def observe_step(self, seqs: int, extra_rows: int, seconds: float) -> None:
        """A target decode step of ``seqs`` sequences with ``extra_rows`` drafted rows."""
        d, s = self.decay, self._sums
        for i, v in enumerate((seqs * seqs, seqs * extra_rows, extra_rows * extra_rows,
                               seqs * seconds, extra_rows * seconds)):
            s[i] = d * s[i] + v
        self.forwards += 1

    def observe_draft(self, seqs: int, seconds: float) -> None:
        """A draft forward choosing one position for each of ``seqs`` sequences."""
        each = seconds / seqs
        self.draft = each if self.draft is None else (
            self.decay * self.draft + (1 - self.decay) * each)
        self.draft_forwards += 1

    def step(self) -> tuple[float, float] | None:
        """(plain, row): a sequence's plain step and a drafted row, in seconds (None: no
        target step observed yet)."""
        nn, nx, xx, ny, xy = self._sums
        if nn <= 0:
            return None
        w, q = self.prior_weight, self.ratio
        # NOTE: minimizes sum (y - N p - x r)^2 + w (r - q p)^2: with nn > 0 never singular
        a, b, c = nn + w * q * q, nx - w * q, xx + w
        det = a * c - b * b
        plain, row = (c * ny - b * xy) / det, (a * xy - b * ny) / det
        return max(plain, 1e-9), max(row, 0.0)

    def choose(self, acceptance: float, k_max: int, seqs: int = 1) -> int | None:
        """The best ``k <= k_max`` for a request with per-token ``acceptance`` in a step of
        ``seqs`` speculating sequences; None while nothing is measured yet."""
        step = self.step()
        if step is None or self.draft is None or min(self.forwards, self.draft_forwards) < 2:
            return None  # NOTE: one forward may be a first call's allocations: measure more
        plain, row = step
        per_draft = row + self.draft
        best_k, best = 0, 1.0 / plain  # NOTE: seqs tokens for seqs * plain seconds
        tokens, chance = float(seqs), 1.0
        for k in range(1, k_max + 1):
            chance *= acceptance
            tokens += chance
            rate = tokens / (seqs * plain + k * per_draft)
            if rate > best:
                best_k, best = k, rate
        return best_k
