"""A draft model's ``k`` priced by its measured costs (issue 21 item 2: never slower than plain
decoding when the draft does not pay; SPEC T4, O1).

The controller (:class:`coda.engine.speculative_costs.DraftCosts`) is tested with injected costs
against a brute-force oracle (tokens per second of every ``k``); the drafter's schedule
(probe, back off, drafts back when they pay) with injected costs; and end to end, a draft that
does not pay (the tiny model drafting for itself, its clock injected so that a draft position
costs what a target step costs) leaves the engine's step count that of plain decoding, the
output unchanged.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.async_engine import AsyncEngine
from coda.engine.draft import PROBE_EVERY, PROBE_K, PROBE_MAX, Drafter, DraftJob
from coda.engine.sampler import SamplingRow
from coda.engine.sequence import Sequence, SequenceStatus
from coda.engine.speculative_costs import DraftCosts
from coda.engine.types import EngineConfig, GenerationRequest
from coda.sampling import SamplingParams
from tests.conftest import examples
from tests.test_speculative import _run


def _costs(plain: float, row: float, draft: float) -> DraftCosts:
    """Costs measured from exact observations of a step ``plain + x * row`` and a draft
    position ``draft`` (seconds)."""
    c = DraftCosts()
    for x in (0, 2, 0, 4, 1, 0):
        c.observe_step(1, x, plain + x * row)
    for _ in range(3):
        c.observe_draft(1, draft)
    return c


def _rate(k: int, a: float, seqs: int, plain: float, per_draft: float) -> float:
    return (seqs + sum(a ** j for j in range(1, k + 1))) / (seqs * plain + k * per_draft)


def test_draft_costing_more_than_it_saves_gets_k_0_and_a_cheap_one_drafts() -> None:
    """The self-draft case (a draft position costs a target step): k = 0 even when every
    draft is accepted; a draft at 1/10 of the target's cost drafts when it agrees often and
    not when it rarely does; nothing measured yet: no verdict (None)."""
    dear = _costs(plain=0.010, row=0.0045, draft=0.010)
    assert dear.choose(1.0, 6) == 0 and dear.choose(0.8, 6) == 0
    cut = _costs(plain=0.010, row=0.0045, draft=0.0087)  # NOTE: 26 of 30 blocks
    assert cut.choose(0.3, 6) == 0 and cut.choose(1.0, 6) == 0
    cheap = _costs(plain=0.010, row=0.0015, draft=0.001)
    assert cheap.choose(0.9, 6) >= 3
    assert cheap.choose(0.1, 6) == 0
    assert DraftCosts().choose(0.9, 6) is None


@settings(max_examples=examples(200), deadline=None)
@given(plain=st.floats(1e-3, 0.1), row=st.floats(0.0, 0.1), extra=st.lists(
    st.tuples(st.integers(1, 4), st.integers(0, 6), st.integers(0, 3)), max_size=12))
def test_property_step_fit_recovers_exact_costs(plain: float, row: float,
                                               extra: list[tuple[int, int, int]]) -> None:
    """For all step costs and decode steps observed (any batch, any drafted rows; ending
    with one plain and one drafted step of one sequence), the fit gives the plain step and the
    drafted row's cost back (to the weak prior's pull, well under 5%)."""
    c = DraftCosts()
    for seqs, x, _ in extra + [(1, 0, 0), (1, 3, 0)]:
        c.observe_step(seqs, x, seqs * plain + x * row)
    got = c.step()
    assert got is not None
    assert got[0] == pytest.approx(plain, rel=0.05)
    assert got[1] == pytest.approx(row, rel=0.05, abs=0.05 * plain)


@settings(max_examples=examples(200), deadline=None)
@given(plain=st.floats(1e-3, 0.1), row=st.floats(0.0, 0.1), draft=st.floats(1e-4, 0.2),
       a=st.floats(0.0, 1.0), k_max=st.integers(1, 8), seqs=st.integers(1, 8))
def test_property_choice_is_the_fastest_k(plain: float, row: float, draft: float, a: float,
                                          k_max: int, seqs: int) -> None:
    """For all costs, acceptances, caps and batch sizes: the chosen k has the most expected
    tokens per second of all k <= k_max (brute force over the measured costs), and k = 0
    exactly when no k beats plain decoding."""
    c = _costs(plain, row, draft)
    step = c.step()
    assert step is not None and c.draft is not None
    p, r = step
    rates = [_rate(k, a, seqs, p, r + c.draft) for k in range(k_max + 1)]
    k = c.choose(a, k_max, seqs)
    assert k is not None
    assert rates[k] == pytest.approx(max(rates), rel=1e-9)
    assert (k == 0) == (max(rates[1:]) <= rates[0] * (1 + 1e-12) and rates.index(max(rates)) == 0)


# ---------------------------------------------------------------- the drafter's schedule
def _drafter(costs: DraftCosts) -> Drafter:
    runner: Any = SimpleNamespace(num_blocks=8, block_size=16)
    return Drafter(runner, "fake", costs=costs)


def _job(seq: Sequence, k: int = 6) -> DraftJob:
    return DraftJob(seq, k, SamplingRow(SamplingParams(temperature=0.0), 0, 0, (), (), frozenset()))


def _emit(seq: Sequence, *tokens: int) -> None:
    for t in tokens:
        seq.num_computed_tokens = seq.num_tokens  # NOTE: as if the step had run
        seq.append_token(t)


def test_a_request_whose_drafts_stop_paying_probes_with_back_off_and_gets_them_back() -> None:
    """With a cheap draft a request drafts (prior acceptance); once its drafts are all
    rejected it decodes plainly, probing with PROBE_K drafts after PROBE_EVERY plain steps,
    then after twice as many; a probe whose drafts are accepted again brings the drafts back.
    A draft too dear to pay even when always accepted waits PROBE_MAX steps between probes."""
    d = _drafter(_costs(plain=0.010, row=0.0015, draft=0.003))  # NOTE: pays at a > 0.45
    seq = Sequence(1, [5, 6, 7], 1 << 20, status=SequenceStatus.RUNNING)
    assert d._price(_job(seq), 1) > 0
    p = d._priced[1]
    for _ in range(8):  # NOTE: every draft rejected (the target chose 99)
        p.pending = (len(seq.all_token_ids), (1, 2, 3))
        _emit(seq, 99)
        d._settle(p, seq.all_token_ids)
    ks = [d._price(_job(seq), 1) for _ in range(3 * PROBE_EVERY)]
    probes = [i for i, k in enumerate(ks) if k]
    assert probes == [PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]
    assert ks[probes[0]] == PROBE_K
    for _ in range(6):  # NOTE: the probes' drafts accepted: acceptance recovers
        p.pending = (len(seq.all_token_ids), (4, 4))
        _emit(seq, 4, 4)
        d._settle(p, seq.all_token_ids)
    assert d._price(_job(seq), 1) > 0

    dear = _drafter(_costs(plain=0.010, row=0.0045, draft=0.010))
    ks = [dear._price(_job(Sequence(2, [5, 6], 1 << 20)), 1) for _ in range(PROBE_MAX)]
    assert [i for i, k in enumerate(ks) if k] == [PROBE_MAX - 1]


# ---------------------------------------------------------------- end to end (tiny model)
def _engine(model: Path, draft: Path | None) -> tuple[AsyncEngine, list[int]]:
    """An engine, and the count of its steps that computed tokens."""
    engine = AsyncEngine.from_model_dir(model, EngineConfig(
        num_blocks=256, enable_prefix_caching=False,
        draft_model=str(draft) if draft is not None else None))
    steps = [0]
    step = engine.core.step

    def counted() -> int:
        n = step()
        steps[0] += n > 0
        return n

    engine.core.step = counted  # type: ignore[method-assign]
    if engine.drafter is not None:
        ticks = itertools.count()
        # NOTE: the injected clock: every timed forward takes one tick, so a draft position
        # costs what a whole target step costs (the self-draft's case): it can never pay
        engine.drafter.clock = lambda: float(next(ticks))
    engine.start()
    return engine, steps


def test_o1_a_draft_that_does_not_pay_leaves_the_step_count_of_plain_decoding(
        server_checkpoint: Path) -> None:
    """T4, O1: the tiny model drafting for itself with the default (priced) k, its costs
    measured on an injected clock where a draft position costs a target step: after the first
    two steps' measuring drafts nothing more is drafted, so the engine takes (to those few
    accepted tokens, one step) the steps plain decoding takes, and the output is plain decoding's."""
    (plain, plain_steps), (spec, spec_steps) = (
        _engine(server_checkpoint, None), _engine(server_checkpoint, server_checkpoint))
    try:
        reqs = [GenerationRequest((40 + i, 41, 42, 43), SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.8, seed=i, ignore_eos=True), max_tokens=40,
            utf8_tail="drop")
            for i in range(4)]
        want, got = _run(plain, reqs, crowd=False), _run(spec, reqs, crowd=False)
        assert [(g.signature, g.text, g.usage) for g in got] == \
            [(w.signature, w.text, w.usage) for w in want]
        drafted = sum((r.speculative or {}).get("drafted", 0) for r in got)
        accepted = sum((r.speculative or {}).get("accepted", 0) for r in got)
        assert drafted <= 2 * PROBE_K  # NOTE: the first two steps measure (DraftCosts.choose)
        # NOTE: those few verifications save at most a step more than they accept
        assert plain_steps[0] - accepted - 2 <= spec_steps[0] <= plain_steps[0]
    finally:
        plain.shutdown()
        spec.shutdown()
