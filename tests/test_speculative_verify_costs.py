"""Prompt lookup's ``k`` priced by the engine's measured verifications (issue 21;
``coda/engine/verify_costs.py``; SPEC T4, O1: choosing ``k`` never changes the output).

:class:`VerifyCosts` against a brute-force oracle on staircase costs (the kernels' row tiles),
its line for the row counts not measured yet, what it observes (one sequence's decode or
verify rows only), ``SpecState.k_for`` using it at batch 1 only, and end to end on the tiny
model with an injected clock: rows that cost nothing draft, rows that cost a lot draft
nothing, and both decode exactly what plain decoding decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coda.engine.runner import SeqChunk
from coda.engine.speculative import SpeculativeConfig
from coda.engine.speculative_state import SpecState
from coda.engine.verify_costs import GAIN, SURE, VerifyCosts
from tests.conftest import examples
from tests.test_speculative import SPEC, _engine, _requests, _run


def _measured(seconds: Sequence[float]) -> VerifyCosts:
    c = VerifyCosts(len(seconds) - 1, 1.2)
    for _ in range(SURE):
        for k, s in enumerate(seconds):
            c.observe(k, s)
    return c


def _rates(a: float, seconds: Sequence[float]) -> list[float]:
    return [sum(a ** j for j in range(k + 1)) / s for k, s in enumerate(seconds)]


def _oracle(a: float, seconds: Sequence[float]) -> int:
    rates = _rates(a, seconds)
    return rates.index(max(rates))  # NOTE: the first best: ties go to fewer drafts


def _is_best(k: int, a: float, seconds: Sequence[float]) -> bool:
    """``k`` is the best row count up to :data:`GAIN` (no k beats it by more), and every
    fewer-drafts count is worse by more than rounding: a tie in exact arithmetic (a row
    costing exactly ``a`` plain steps) goes to fewer drafts, however it rounds."""
    rates = _rates(a, seconds)
    best = all(r <= rates[k] * (1 + 2 * GAIN) for r in rates)
    return best and all(r * (1 + GAIN / 2) < rates[k] for r in rates[:k])


@settings(max_examples=examples(200), deadline=None)
@given(plain=st.floats(1e-3, 0.1), steps=st.lists(st.floats(0.0, 2.0), min_size=8, max_size=8),
       a=st.floats(0.0, 1.0))
# NOTE: a fresh run's falsifying example: one row costs exactly a plain steps, a tie
@example(plain=0.051939591790613325, steps=[0.65625, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
         a=0.65625)
def test_t4_batch_1_k_is_the_best_measured_tokens_per_second(plain: float, steps: list[float],
                                                           a: float) -> None:
    """Every row count measured (a staircase: each extra row costs 0 to 2 plain steps): the
    chosen k is the brute-force best of (1 + a + .. + a^k) / seconds(k)."""
    seconds = [plain]
    for s in steps:
        seconds.append(seconds[-1] + s * plain)
    k = _measured(seconds).choose(a, 8)
    assert k is not None and _is_best(k, a, seconds), (k, _oracle(a, seconds))
    if max(_rates(a, seconds)) > sorted(_rates(a, seconds))[-2] * (1 + 4 * GAIN):
        assert k == _oracle(a, seconds)  # NOTE: a clear best: exactly the brute force's


def test_the_smollm2_avx512_staircase_picks_3_where_a_line_overdrafts() -> None:
    """The costs measured for SmolLM2 Q4_1 on AVX-512 at a 400-token context (ms, k = 0..8;
    the 5-row tile is the step up): k = 3 from a = 0.7 to 0.9, where the row rule with the
    machine's fitted F (3.2) drafts 4 to 8 at a loss of up to 14% (docs/speculative.md)."""
    ms = [23.0, 29.0, 32.1, 35.8, 45.5, 50.55, 55.6, 60.65, 65.7]
    costs = _measured(ms)
    assert [costs.choose(a, 8) for a in (0.2, 0.4, 0.7, 0.8, 0.9, 0.97)] == [0, 2, 3, 3, 3, 8]
    assert costs.choose(0.9, 2) == 2  # NOTE: never past the cap


def test_row_counts_not_measured_are_priced_by_the_fitted_line() -> None:
    """Measured k = 0, 1, 2 on a line (plain 10 ms, a row 2 ms): k = 5 is priced on that
    line, so a request that copies tries it (and then it is measured); nothing chosen before
    two forwards with a plain one among them."""
    c = VerifyCosts(8, 1.2)
    assert c.choose(0.9, 8) is None
    c.observe(1, 0.012)
    c.observe(2, 0.014)
    assert c.choose(0.9, 8) is None  # NOTE: no plain step measured yet
    c.observe(0, 0.010)
    assert c.price(5) == pytest.approx(0.020, rel=0.02)
    assert c.choose(0.95, 8) == 8
    for _ in range(SURE):
        c.observe(5, 0.5)
    assert c.price(5) == 0.5 and c.choose(0.95, 8) != 5


def test_one_slow_forward_does_not_price_a_k_out_for_good() -> None:
    """The shared machine's case (free text, T = 0.8, SmolLM2): plain steps 20 ms, two and
    three drafts measured at 34 and 38 ms, one draft measured once at 41 ms (a loaded
    moment; it costs ~27 on the line). At a = 0.45 one draft is the best buy, and it must
    stay choosable: priced by its one reading it is never chosen, so never measured again,
    and the request drafts 3 rows where 1 pays. Once measured SURE times, its own average
    stands."""
    c = VerifyCosts(8, 1.2)
    for _ in range(20):
        c.observe(0, 0.020)
    for _ in range(SURE):
        c.observe(2, 0.034)
        c.observe(3, 0.038)
    c.observe(1, 0.041)
    assert c.price(1) < 0.030
    assert c.choose(0.45, 8) == 1
    for _ in range(SURE - 1):
        c.observe(1, 0.041)
    assert c.price(1) == pytest.approx(0.041) and c.choose(0.45, 8) != 1


def test_only_one_sequences_decode_or_verify_forward_is_observed() -> None:
    """A prefill chunk, a batch of two, a chunk without logits: not a verification's cost;
    one sequence's pending token plus k drafts: observed as k, on the injected clock."""
    now = [0.0]
    c = VerifyCosts(8, 1.2, clock=lambda: now[0])

    def execute(chunks: Sequence[SeqChunk]) -> str:
        now[0] += 0.001 * sum(len(ch.token_ids) for ch in chunks)
        return "logits"

    table = (0, 1)
    assert c.timed(execute, [SeqChunk((5, 6, 7), 0, table, True)]) == "logits"  # prefill
    c.timed(execute, [SeqChunk((5,), 3, table, True), SeqChunk((6,), 3, table, True)])
    c.timed(execute, [SeqChunk((5,), 3, table, False)])
    assert c.forwards == 0
    c.timed(execute, [SeqChunk((5, 8, 9), 3, table, True, 3)])
    c.timed(execute, [SeqChunk((5,), 3, table, True)])
    assert c.forwards == 2
    assert c.seconds[2] == pytest.approx(0.003) and c.seconds[0] == pytest.approx(0.001)


def test_spec_state_uses_the_measured_costs_at_batch_1_only() -> None:
    """k_for(1) is the costs' choice (here: rows so cheap that every draft pays); in a crowd
    the row rule decides (a = 0.65 < 4 / 5.2: none)."""
    costs = _measured([0.010] * 9)
    state = SpecState(SpeculativeConfig(costs=costs))
    assert state.k_for(1) == 8
    assert state.k_for(4) == 0
    assert SpecState(SpeculativeConfig()).k_for(1) == 1  # NOTE: the row rule: 0.65 > 1/2.2


def _priced(engine: Any, row: float) -> None:
    """The engine's forwards cost 10 ms plus ``row`` per drafted row on its verify costs'
    clock (injected: the test decides what a row costs)."""
    now = [0.0]
    runner = engine.core.runner
    execute = runner.execute

    def timed(chunks: Sequence[SeqChunk]) -> Any:
        now[0] += 0.010 + row * sum(c.num_logits - 1 for c in chunks)
        return execute(chunks)

    runner.execute = timed
    engine.core.verify_costs.clock = lambda: now[0]


@pytest.mark.parametrize(("row", "drafts"), [(0.0, True), (1.0, False)])
def test_t4_o1_measured_costs_decide_the_drafts_and_the_output_is_plain_decodings(
        server_checkpoint: Path, row: float, drafts: bool) -> None:
    """T4, O1 end to end (the serving engine's default pricing, not the tests' eager k):
    one request at a time, drafted rows that cost nothing are drafted, rows that cost 100
    plain steps never are after the first measurements, and either way every output equals
    plain decoding's (text, tokens, logprobs, finish reason, usage)."""
    plain = _engine(server_checkpoint, "off", eager=False, enable_prefix_caching=False)
    spec = _engine(server_checkpoint, SPEC, eager=False, enable_prefix_caching=False)
    try:
        assert spec.core.verify_costs is not None and spec.speculative is not None
        assert spec.speculative.costs is spec.core.verify_costs
        _priced(spec, row)
        reqs = _requests(6, plain.limits.vocab_size, seed=5, max_tokens=32)
        want = _run(plain, reqs, crowd=False)
        got = _run(spec, reqs, crowd=False)
        assert [(g.signature, g.text, g.finish_reason, g.usage) for g in got] == \
            [(w.signature, w.text, w.finish_reason, w.usage) for w in want]
        drafted = sum((g.speculative or {}).get("drafted", 0) for g in got[2:])
        assert (drafted > 0) == drafts, drafted
    finally:
        plain.shutdown()
        spec.shutdown()
