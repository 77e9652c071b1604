"""The batched sampler: every parameter's effect, logprobs, and the per-request RNG (SPEC T4)."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.rng import counter_uniforms, row_keys
from coda.engine.sampler import Sampler, SamplingRow, TokenDecision, _draw, _row_max
from coda.errors import ModelError
from coda.sampling import SamplingParams
from tests.conftest import examples

SAMPLER = Sampler()


def row(params: SamplingParams | None = None, *, seed: int = 0, step: int = 0,
        prompt: Sequence[int] = (), output: Sequence[int] = (),
        eos: frozenset[int] = frozenset(), mask: torch.Tensor | None = None) -> SamplingRow:
    return SamplingRow(params or SamplingParams(), seed, step, prompt, output, eos, mask)


def choose(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    if logits.dim() == 1:
        logits = logits.expand(len(rows), -1)
    return [d.token_id for d in SAMPLER.sample(logits, rows)]


def many_steps(params: SamplingParams, n: int = 300, **kw: object) -> list[SamplingRow]:
    """n rows of one request at steps 0..n-1 (one call samples n independent steps)."""
    return [row(params, seed=11, step=t, **kw) for t in range(n)]  # type: ignore[arg-type]


LOGITS = torch.tensor([1.0, 3.0, 0.5, 2.5, -1.0, 0.0, 2.0, -3.0])


# --- each parameter's effect -------------------------------------------------------------

def test_greedy_is_argmax_and_ignores_seed() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    rows = [row(SamplingParams(temperature=0), seed=s, step=s) for s in range(5)]
    decisions = SAMPLER.sample(logits, rows)
    assert [d.token_id for d in decisions] == logits.argmax(-1).tolist()
    assert all(d.greedy for d in decisions)


@settings(max_examples=examples(60), deadline=None)
@given(rows=st.lists(st.lists(st.sampled_from([0.0, -0.0, 1.5, -2.0, 3.0, float("inf"),
                                               float("-inf"), 1e-30]),
                              min_size=1, max_size=12), min_size=1, max_size=4),
       width=st.integers(1, 12))
def test_t4_greedy_row_max_is_torch_max_first_index_ties_and_signed_zeros(
        rows: list[list[float]], width: int) -> None:
    """T4 / issue 21: the sampler's fast row maximum (numpy's argmax on the CPU) picks what
    torch's ``max(-1)`` picks, the FIRST maximal index, with ties, -0.0 beside +0.0, +-inf and
    all -inf rows; the value is that logit's."""
    x = torch.tensor([(r * width)[:width] for r in rows], dtype=torch.float32)
    best, idx = _row_max(x)
    want_best, want_idx = x.max(-1)
    assert idx.dtype == torch.int64 and torch.equal(idx, want_idx)
    assert torch.equal(best.view(torch.int32), want_best.view(torch.int32))


def test_top_k_one_is_greedy_at_any_temperature() -> None:
    assert set(choose(LOGITS, many_steps(SamplingParams(temperature=1.7, top_k=1)))) == {1}


def test_tiny_top_p_is_argmax() -> None:
    assert set(choose(LOGITS, many_steps(SamplingParams(temperature=2.0, top_p=1e-6)))) == {1}


def test_top_k_keeps_exactly_the_k_best() -> None:
    chosen = Counter(choose(LOGITS, many_steps(SamplingParams(temperature=3.0, top_k=3))))
    assert set(chosen) == {1, 3, 6}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = torch.softmax(LOGITS, -1)  # sorted masses: 0.44, 0.27, 0.16, 0.06, ...
    nucleus_mass = float(probs[[1, 3]].sum())
    params = SamplingParams(top_p=nucleus_mass + 0.01)  # needs a third token (6) to reach it
    assert set(choose(LOGITS, many_steps(params))) == {1, 3, 6}
    assert set(choose(LOGITS, many_steps(SamplingParams(top_p=nucleus_mass - 0.01)))) == {1, 3}


def _nucleus_reference(values: list[float], top_p: float) -> set[int]:
    """Float64 statement of top-p: keep a token iff the mass of strictly better ones is < p."""
    best = max(values)
    weights = [math.exp(v - best) for v in values]
    total = sum(weights)
    return {i for i, v in enumerate(values)
            if sum(w for u, w in zip(values, weights, strict=True) if u > v) / total < top_p}


@pytest.mark.parametrize("scale", [8.0, 0.5])  # nucleus inside / far beyond the 256-token window
def test_top_p_matches_the_reference_inside_and_beyond_the_window(scale: float) -> None:
    values = (torch.randn(1000, generator=torch.Generator().manual_seed(4)) * scale).tolist()
    logits = torch.tensor([values, values])
    rows = [row(SamplingParams(top_p=0.9)), row(SamplingParams(top_k=5))]  # mixed windows
    processed = SAMPLER.process(logits, rows)
    kept = set(torch.isfinite(processed[0]).nonzero().flatten().tolist())
    assert kept == _nucleus_reference(values, 0.9)
    assert len(kept) > 256 if scale < 1 else len(kept) < 256
    assert int(torch.isfinite(processed[1]).sum()) == 5


def test_truncation_is_by_value_so_ties_stay_together() -> None:
    logits = torch.tensor([[3.0, 2.0, 2.0, 1.0, 2.0]])
    kept = torch.isfinite(SAMPLER.process(logits, [row(SamplingParams(top_k=2))]))
    assert kept[0].tolist() == [True, True, True, False, True]


def test_min_p_drops_tokens_below_the_fraction_of_the_best() -> None:
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert set(choose(logits, many_steps(SamplingParams(min_p=0.2)))) == {0, 1, 2}
    assert set(choose(logits, many_steps(SamplingParams(min_p=0.5)))) == {0, 1}
    processed = SAMPLER.process(logits[None], [row(SamplingParams(min_p=0.2))])
    assert processed[0, 3] == -math.inf and torch.isfinite(processed[0, :3]).all()


def test_penalties_change_exactly_the_right_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    seen = dict(prompt=[0], output=[1, 1, 3])
    rep = SAMPLER.process(logits, [row(SamplingParams(repetition_penalty=2.0), **seen)])
    assert rep[0].tolist() == [1.0, -2.0, 0.5, 1.5, -2.0, 1.0]  # prompt and output, sign-aware
    freq = SAMPLER.process(logits, [row(SamplingParams(frequency_penalty=0.5), **seen)])
    assert freq[0].tolist() == [2.0, -2.0, 0.5, 2.5, -2.0, 1.0]  # output only, per occurrence
    pres = SAMPLER.process(logits, [row(SamplingParams(presence_penalty=-0.25), **seen)])
    assert pres[0].tolist() == [2.0, -0.75, 0.5, 3.25, -2.0, 1.0]  # output only, once
    both = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert SAMPLER.process(logits, [row(both, **seen)])[0].tolist() == [
        1.0, -3.25, 0.5, 0.75, -2.0, 1.0]
    neutral = SAMPLER.process(logits, [row(SamplingParams(), **seen)])
    assert torch.equal(neutral, logits)


def test_penalties_apply_per_row_in_a_batch() -> None:
    logits = torch.zeros(3, 4) + torch.tensor([1.0, 1.0, 1.0, 1.0])
    rows = [row(SamplingParams(frequency_penalty=1.0), output=[0]),
            row(SamplingParams(), output=[1]),
            row(SamplingParams(repetition_penalty=4.0), prompt=[2], output=[2])]
    assert SAMPLER.process(logits, rows).tolist() == [
        [0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.25, 1.0]]


def test_logit_bias_minus_100_bans_and_plus_100_forces() -> None:
    ban = SamplingParams(temperature=1.0, logit_bias={1: -100})
    assert 1 not in choose(LOGITS, many_steps(ban))
    force = SamplingParams(temperature=1.0, logit_bias={7: 100})
    assert set(choose(LOGITS, many_steps(force))) == {7}
    processed = SAMPLER.process(LOGITS[None], [row(SamplingParams(logit_bias={2: 1.5}))])
    assert processed[0, 2] == 2.0


def test_min_tokens_bans_eos_until_reached() -> None:
    greedy = SamplingParams(temperature=0, min_tokens=2)
    eos = frozenset({1, 3})  # the two best tokens
    assert choose(LOGITS, [row(greedy, output=[], eos=eos)]) == [6]
    assert choose(LOGITS, [row(greedy, output=[0], eos=eos)]) == [6]
    assert choose(LOGITS, [row(greedy, output=[0, 0], eos=eos)]) == [1]
    sampled = SamplingParams(temperature=5.0, min_tokens=1)
    assert not {1, 3} & set(choose(LOGITS, many_steps(sampled, eos=eos)))


def test_min_tokens_never_overrides_a_grammar_that_only_allows_eos() -> None:
    mask = torch.zeros(8, dtype=torch.bool)
    mask[3] = True
    params = SamplingParams(min_tokens=5)
    assert choose(LOGITS, [row(params, eos=frozenset({3}), mask=mask)]) == [3]


def test_mask_is_respected_and_an_empty_mask_fails_as_model_error() -> None:
    mask = torch.tensor([False, False, True, False, True, False, False, True])
    assert set(choose(LOGITS, many_steps(SamplingParams(temperature=2.0), mask=mask))) == {2, 4, 7}
    assert choose(LOGITS, [row(SamplingParams(temperature=0), mask=mask)]) == [2]
    with pytest.raises(ModelError):
        SAMPLER.sample(LOGITS[None], [row(mask=torch.zeros(8, dtype=torch.bool))])


def test_bad_inputs_raise_model_error() -> None:
    """L5: a sampling failure is a model error, never a transport error."""
    with pytest.raises(ModelError):
        SAMPLER.sample(torch.zeros(2, 8), [row()])
    with pytest.raises(ModelError):
        SAMPLER.sample(torch.zeros(2, 8), [])
    with pytest.raises(ModelError):
        SAMPLER.sample(torch.tensor([[0.0, math.nan]]), [row()])
    with pytest.raises(ModelError):
        SAMPLER.sample(LOGITS[None], [row(SamplingParams(logit_bias={8: 1.0}))])
    assert SAMPLER.sample(torch.zeros(0, 8), []) == []


def test_caller_logits_are_not_mutated_and_bf16_is_accepted() -> None:
    logits = LOGITS[None].clone()
    params = SamplingParams(repetition_penalty=3.0, logit_bias={0: 5.0}, top_k=2)
    SAMPLER.sample(logits, [row(params, output=[1, 3])])
    assert torch.equal(logits, LOGITS[None])
    assert choose(LOGITS.to(torch.bfloat16), [row(SamplingParams(temperature=0))]) == [1]


# --- decision record: logprobs and prob ----------------------------------------------------

def test_logprobs_and_top_logprobs_match_raw_log_softmax() -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(logprobs=5, repetition_penalty=1.5, temperature=0.7),
              SamplingParams(logprobs=0), SamplingParams(temperature=0)]
    decisions = SAMPLER.sample(logits, [row(p, output=[0, 1], step=4) for p in params])
    raw = torch.log_softmax(logits, -1)
    for i, decision in enumerate(decisions):
        assert decision.logprob == pytest.approx(float(raw[i, decision.token_id]), abs=1e-6)
    vals, ids = raw[0].topk(5)
    assert [t for t, _ in decisions[0].top_logprobs] == ids.tolist()
    assert [lp for _, lp in decisions[0].top_logprobs] == pytest.approx(vals.tolist(), abs=1e-6)
    assert decisions[1].top_logprobs == () and decisions[2].top_logprobs == ()


def test_prob_is_under_the_processed_distribution() -> None:
    decision = SAMPLER.sample(LOGITS[None], [row(SamplingParams(temperature=0))])[0]
    assert decision.prob == pytest.approx(float(torch.softmax(LOGITS, -1)[1]), abs=1e-6)
    sampled = SAMPLER.sample(LOGITS[None], [row(SamplingParams(temperature=0.5, top_k=2))])[0]
    expected = torch.softmax(LOGITS[[1, 3]] / 0.5, -1)[[1, 3].index(sampled.token_id)]
    assert sampled.prob == pytest.approx(float(expected), abs=1e-6)


def test_to_record_is_strict_json() -> None:
    decision = TokenDecision(4, -math.inf, 0.25, ((4, -0.5), (2, -math.inf)), False)
    record = decision.to_record()
    assert json.loads(json.dumps(record, allow_nan=False)) == {
        "token_id": 4, "logprob": None, "prob": 0.25,
        "top_logprobs": [[4, -0.5], [2, None]], "greedy": False}


# --- the per-request RNG (T4) ------------------------------------------------------------

def _splitmix_reference(seed: int, step: int, v: int) -> float:
    """Pure-Python statement of the documented scheme, independent of torch's int64 ops."""
    m = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    key = mix(mix(seed & m) ^ step)
    return ((mix((key + (v + 1) * 0x9E3779B97F4A7C15) & m) >> 41) + 0.5) / 2**23


def test_t4_counter_uniforms_match_the_documented_hash() -> None:
    cases = [(0, 0), (1, 0), (12345, 7), (-3, 1), (2**63 + 5, 99), (2**64 - 1, 2**31)]
    got = counter_uniforms([s for s, _ in cases], [t for _, t in cases], 64)
    for i, (seed, step) in enumerate(cases):
        for v in (0, 1, 31, 63):
            assert float(got[i, v]) == _splitmix_reference(seed, step, v)
    assert float(got.min()) > 0.0 and float(got.max()) < 1.0


def test_t4_uniform_extremes_stay_strictly_inside_zero_and_one() -> None:
    """The largest and smallest 23-bit values must not round to 0 or 1 (the draw needs 0 < u < 1)."""
    extremes = (torch.tensor([0.0, 2.0**23 - 1]) + 0.5) * (2.0**-23)
    assert float(extremes[0]) > 0.0 and float(extremes[1]) < 1.0
    assert torch.isfinite(-torch.log(-torch.log(extremes))).all()


def test_t4_same_seed_and_step_give_the_same_token_in_any_batch() -> None:
    """T4 RNG cursor: the draw depends on (seed, step, logits) only — not on neighbours, row
    index, batch size or order — so a preempted request resumes with the same tokens."""
    rng = random.Random(5)
    vocab = 300
    gen = torch.Generator().manual_seed(9)
    for case in range(6):
        target_logits = torch.randn(vocab, generator=gen) * 2
        params = SamplingParams(temperature=1.0 + 0.2 * case, top_p=0.95, top_k=100 * (case % 2),
                                repetition_penalty=1.1, logit_bias={5: 2.0}, min_p=0.01)
        target = row(params, seed=rng.randrange(2**40), step=rng.randrange(500),
                     prompt=[1, 2, 3], output=[4, 5])
        alone = choose(target_logits, [target])[0]
        for size in (8, 32):
            for _ in range(2):
                neighbours = [
                    row(SamplingParams(temperature=rng.choice([0.0, 0.5, 1.5]),
                                       top_k=rng.choice([0, 5]), top_p=rng.choice([1.0, 0.8]),
                                       frequency_penalty=rng.choice([0.0, 1.0])),
                        seed=rng.randrange(2**40), step=rng.randrange(500),
                        output=[rng.randrange(vocab) for _ in range(rng.randrange(6))])
                    for _ in range(size - 1)]
                position = rng.randrange(size)
                rows = neighbours[:position] + [target] + neighbours[position:]
                logits = torch.randn(size, vocab, generator=gen) * 3
                logits[position] = target_logits
                assert choose(logits, rows)[position] == alone


def test_t4_different_seeds_and_steps_draw_differently() -> None:
    flat = torch.zeros(1000)
    by_seed = choose(flat, [row(seed=s, step=0) for s in range(20)])
    by_step = choose(flat, [row(seed=7, step=t) for t in range(20)])
    assert len(set(by_seed)) >= 15 and len(set(by_step)) >= 15
    assert by_seed != by_step


def test_empirical_distribution_follows_softmax() -> None:
    """The inverse-CDF draw over the counter hash samples softmax(logits / T); fixed seeds: deterministic."""
    logits = torch.tensor([0.2, 1.0, -0.5, 0.7, 0.0, -1.5])
    expected = torch.softmax(logits / 0.8, -1).tolist()
    n = 4000
    params = SamplingParams(temperature=0.8)
    for rows in ([row(params, seed=42, step=t) for t in range(n)],
                 [row(params, seed=s, step=3) for s in range(n)]):
        counts = Counter(choose(logits, rows))
        for token, p in enumerate(expected):
            assert abs(counts[token] / n - p) < 0.03, (token, counts[token] / n, p)


# --- property: the choice is always allowed ----------------------------------------------

@settings(deadline=None, max_examples=150)
@given(
    data=st.data(),
    vocab=st.integers(2, 12),
    temperature=st.one_of(st.just(0.0), st.floats(1e-7, 3.0)),
    top_p=st.floats(0.01, 1.0),
    min_p=st.sampled_from([0.0, 0.0, 0.1, 0.5]),
    seed=st.integers(0, 2**64),
    step=st.integers(0, 10_000),
)
def test_property_choice_is_allowed_by_mask_top_k_top_p_and_min_p(
    data: st.DataObject, vocab: int, temperature: float, top_p: float, min_p: float,
    seed: int, step: int,
) -> None:
    # NOTE: width=32 so that distinct values stay distinct in the sampler's float32; no
    # subnormals, which vectorised CPU kernels may flush to zero (a tie the oracle can't see).
    values = data.draw(st.lists(st.floats(-6.0, 6.0, width=32, allow_subnormal=False),
                                min_size=vocab,
                                max_size=vocab, unique=True))
    mask_list = data.draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab))
    mask_list[data.draw(st.integers(0, vocab - 1))] = True
    top_k = data.draw(st.integers(0, vocab))
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    logits = torch.tensor(values)
    token = choose(logits, [row(params, seed=seed, step=step, mask=torch.tensor(mask_list))])[0]

    assert mask_list[token]
    allowed = [v for v, ok in zip(values, mask_list, strict=True) if ok]
    if params.is_greedy:
        assert values[token] == max(allowed)
        return
    better = [v for v in allowed if v > values[token]]
    assert top_k == 0 or len(better) < top_k
    survivors = sorted(allowed, reverse=True)[: top_k or None]
    weights = [math.exp((v - survivors[0]) / temperature) for v in survivors]
    mass_before = sum(w for v, w in zip(survivors, weights, strict=True) if v > values[token])
    assert mass_before / sum(weights) < top_p + 1e-5
    assert math.exp((values[token] - survivors[0]) / temperature) >= min_p - 1e-5


def test_t4_draw_never_picks_a_banned_token_and_depends_on_the_row_only() -> None:
    """Inverse-CDF draw: -inf tokens have zero mass and are never chosen; a row's token does
    not depend on the other rows of the batch (T4)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 64, generator=gen)
    x[0, 1:] = float("-inf")  # one live token
    x[1, ::2] = float("-inf")  # odd ids only
    x[2, [3, 9]] = 1.0
    x[2, [i for i in range(64) if i not in (3, 9)]] = float("-inf")
    for step in range(200):
        keys = row_keys(list(range(6)), [step] * 6, "cpu")
        got = _draw(x, keys)
        assert got[0] == 0 and got[1] % 2 == 1 and int(got[2]) in (3, 9)
        for i in range(6):
            assert torch.equal(_draw(x[i : i + 1], keys[i : i + 1]), got[i : i + 1])
