"""Exact prompt-lookup (n-gram) speculative decoding (issue 21; SPEC T1, T4, G1, L6, L7, O1).

**Drafting.** A request drafts from its own prompt and output: the longest suffix n-gram
(``max_ngram`` down to ``min_ngram`` tokens) that occurred earlier in ``prompt + output``
proposes the tokens that followed its most recent earlier occurrence, at most ``k`` of them.
``k`` adapts (all drafts accepted: ``k + 2``, else one past the accepted run), within
``1 .. k_max`` and the request's budget: the last verified row picks output token
``max_tokens - 1`` at the latest, so a draft never reaches past the budget or the context.

**Verification** is the same engine step: the drafted tokens ride after the sequence's pending
token as extra query rows of its chunk (:class:`~coda.engine.scheduler.ScheduledChunk`
``num_draft``), and every row's logits come back. The model's rows are batch invariant (T4: the
load refuses speculation in a mode that is not), so row ``j`` has exactly the logits plain
decoding would compute after the accepted prefix.

**Acceptance (sample-and-match).** Row ``j`` is sampled as plain decoding samples output
position ``t + j``: the processed logits use the prefix ``output + drafts[:j]`` (penalties,
min_tokens) and the request's counter RNG at step ``t + j`` (:func:`verify_rows`). The drafted
token is accepted iff it equals that pick; the first mismatch emits the pick and drops the
rest; when all ``k`` match, row ``k``'s pick is a bonus token. Not ``min(1, p/q)`` rejection
sampling: that keeps the distribution, not the seeded output.

**Emission** (the core): every emitted token goes through the exact loop one by one
(``EngineCore._on_decision``), so a stop string, stop id, EOS, max_tokens or context limit in
an accepted run ends the request where plain decoding ends it; cancel, deadline and a paused
reader are checked before each token after the first. Before each accepted draft is followed,
its K/V (written by this step's forward) is committed (``Scheduler.commit_draft``) with the
same ``decode.started``/``decode.completed`` rows and processed count plain decoding writes
(L6, O1). The rejected tail is rolled back (``Scheduler.rollback``: its blocks freed, never
registered in the prefix cache), so nothing of it reaches the stream, the usage or the cache.

Requests whose choice depends on state that the per-token loop advances (a grammar, the budget
closer, a reasoning budget) do not speculate in this slice. A request whose acceptance stays
below ``min_acceptance`` over its last ``window`` verifications stops speculating.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace

from coda.engine.plan import RequestPlan
from coda.engine.sampler import SamplingRow, TokenDecision
from coda.engine.sequence import Sequence

MODES = ("off", "prompt-lookup")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Prompt-lookup knobs (defaults measured in docs/speculative.md)."""

    min_ngram: int = 2
    max_ngram: int = 4
    k_start: int = 4
    k_max: int = 8
    window: int = 8              # verifications the acceptance rate is judged over
    min_acceptance: float = 0.3  # below it (over a full window) the request stops drafting

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram or not 1 <= self.k_start <= self.k_max:
            raise ValueError("SpeculativeConfig: need 1 <= min_ngram <= max_ngram and "
                             "1 <= k_start <= k_max")


def refusal(mode: str, batch_invariant: bool, mode_name: str) -> str | None:
    """Why ``--speculative mode`` cannot run on this load (None: it can)."""
    if mode not in MODES:
        return f"unknown --speculative {mode!r}; modes: {', '.join(MODES)}"
    if mode != "off" and not batch_invariant:
        return (f"--speculative {mode} needs a batch-invariant serving mode (T4): verifying "
                f"drafted tokens as extra rows gives plain decoding's logits only where a "
                f"row's bits do not depend on its batch; --quant {mode_name} is NOT "
                f"batch-invariant (use --quant auto)")
    return None


def state_for(config: SpeculativeConfig | None, plan: RequestPlan) -> SpecState | None:
    """The request's speculation state, or None where it does not speculate (off on the
    server, ``speculative: false`` on the request, or a choice this slice cannot verify
    ahead: a grammar or a reasoning budget)."""
    if config is None or not plan.speculative or plan.grammar is not None:
        return None
    if plan.reasoning is not None and plan.reasoning.max_tokens is not None:
        return None
    return SpecState(config)


class SpecState:
    """One request's drafting state: the n-gram index over its tokens, the current ``k``, the
    recent acceptance, and the counts the terminal reports (``coda.speculative``)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.k_start
        self.on = True
        self.counts: dict[str, int] = {"drafted": 0, "accepted": 0, "rejected": 0,
                                       "verify_steps": 0}
        self._recent: deque[tuple[int, int]] = deque(maxlen=config.window)
        # NOTE: per n: n-gram -> index of the token after its most recent occurrence
        self._index: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)}
        self._indexed = 0

    def propose(self, seq: Sequence, max_tokens: int) -> tuple[int, ...]:
        """Drafts for output positions ``t + 1 ..`` of a sequence about to decode token ``t``
        (one uncomputed token), or () when nothing matches or nothing fits."""
        room = max_tokens - seq.num_output_tokens - 1
        if not self.on or room <= 0 or seq.num_uncomputed_tokens != 1:
            return ()
        tokens = seq.all_token_ids
        n_tok = len(tokens)
        for end in range(max(self._indexed, 1), n_tok):  # NOTE: end < n_tok: a follower exists
            for n, index in self._index.items():
                if end >= n:
                    index[tuple(tokens[end - n:end])] = end
        self._indexed = n_tok
        for n in range(self.config.max_ngram, self.config.min_ngram - 1, -1):
            at = self._index[n].get(tuple(tokens[n_tok - n:])) if n_tok >= n else None
            if at is not None:
                return tuple(tokens[at:at + min(self.k, room)])
        return ()

    def record(self, drafted: int, accepted: int) -> None:
        """One verification's outcome: counts, the next ``k``, and the low-acceptance switch."""
        c = self.counts
        c["drafted"] += drafted
        c["accepted"] += accepted
        c["rejected"] += drafted - accepted
        c["verify_steps"] += 1
        cfg = self.config
        self.k = min(cfg.k_max, self.k + 2) if accepted == drafted else max(1, accepted + 1)
        self._recent.append((drafted, accepted))
        if len(self._recent) == cfg.window:
            total = sum(d for d, _ in self._recent)
            if sum(a for _, a in self._recent) < cfg.min_acceptance * total:
                self.on = False  # NOTE: stays plain decoding from here on


def verify_rows(base: SamplingRow, drafts: Seq[int]) -> list[SamplingRow]:
    """Rows ``0..k`` of a verification: row ``j`` is what plain decoding samples at output
    position ``base.step + j`` once ``drafts[:j]`` were chosen (row 0 is ``base`` itself)."""
    out = list(base.output_token_ids)
    return [base] + [replace(base, step=base.step + j, output_token_ids=out + list(drafts[:j]))
                     for j in range(1, len(drafts) + 1)]


def accepted_prefix(drafts: Seq[int], decisions: Seq[TokenDecision]) -> int:
    """How many drafted tokens equal the pick of their row (the sample-and-match rule)."""
    a = 0
    while a < len(drafts) and decisions[a].token_id == drafts[a]:
        a += 1
    return a
