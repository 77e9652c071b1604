"""The sampler against a brute-force, float64 pure-Python statement of its contract (SPEC T4,
O1, L5): for all batches of rows, the processed logits (penalties, bias, mask, EOS ban,
temperature, top-k, top-p, min-p), the greedy pick (numpy's first-index tie rule), the seeded
inverse-CDF draw, ``logprob``, ``prob`` and ``top_logprobs``.

Inputs lie on a binary grid (logits in steps of 0.5, penalties, biases and temperatures powers
of two or small multiples of 0.25), so every arithmetic step before truncation is exact in
float32 and float64 alike and the processed logits are compared with ``==``. The mass
comparisons (top-p, min-p, the draw) are compared where the reference is not within rounding
of a boundary (``assume``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from coda.engine.rng import counter_uniforms
from coda.engine.sampler import Sampler, SamplingRow, TokenDecision
from coda.errors import ModelError
from coda.sampling import SamplingParams
from tests.conftest import examples

SAMPLER = Sampler()
_INF = math.inf
_MARGIN = 1e-4  # NOTE: float32 softmax/cumsum error on these sizes is far below this


class _Dead(Exception):
    """The reference's verdict: a row with no token left (the sampler raises ModelError)."""


@dataclass(frozen=True)
class _Ref:
    processed: list[float]       # -inf: not allowed
    near_boundary: bool          # a top-p / min-p comparison within rounding of its bound


def _softmax(x: Sequence[float]) -> list[float]:
    best = max(x)
    w = [math.exp(v - best) if v > -_INF else 0.0 for v in x]
    total = sum(w)
    return [v / total for v in w]


def _reference(raw: Sequence[float], r: SamplingRow) -> _Ref:
    """The module docstring's pipeline, one row, in float64, by definition."""
    p, vocab = r.params, len(raw)
    x = list(raw)
    if p.repetition_penalty != 1.0:
        for t in set(r.prompt_token_ids) | set(r.output_token_ids):
            if 0 <= t < vocab:
                x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(r.output_token_ids):
        if 0 <= t < vocab:
            n = list(r.output_token_ids).count(t)
            x[t] -= p.frequency_penalty * n + p.presence_penalty
    for t, b in p.logit_bias:
        x[t] += b
    allowed = [True] * vocab if r.allowed_token_ids_mask is None else \
        [bool(v) for v in r.allowed_token_ids_mask.tolist()]
    if len(r.output_token_ids) < p.min_tokens:
        banned = [a and t not in r.eos_token_ids for t, a in enumerate(allowed)]
        if any(banned):  # NOTE: min_tokens never overrides a grammar that allows only EOS
            allowed = banned
    x = [v if a else -_INF for v, a in zip(x, allowed, strict=True)]
    if max(x) == -_INF:
        raise _Dead
    temp = 1.0 if p.is_greedy else p.temperature
    x = [v / temp for v in x]
    near = False
    if 0 < p.top_k < vocab:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else -_INF for v in x]
    if p.top_p < 1.0:
        probs = _softmax(x)
        before = [sum(q for u, q in zip(x, probs, strict=True) if u > v) for v in x]
        near = any(abs(b - p.top_p) < _MARGIN for b, v in zip(before, x, strict=True)
                   if v > -_INF)
        x = [v if b < p.top_p or v == max(x) else -_INF for v, b in zip(x, before, strict=True)]
    if p.min_p:
        probs = _softmax(x)
        floor = max(probs) * p.min_p
        near = near or any(0 < abs(q - floor) < _MARGIN for q in probs)
        x = [v if q >= floor else -_INF for v, q in zip(x, probs, strict=True)]
    return _Ref(x, near)


def _first_argmax(x: Sequence[float]) -> int:
    return max(range(len(x)), key=lambda i: (x[i], -i))


def _draw_reference(x: Sequence[float], seed: int, step: int) -> tuple[int, bool]:
    """The first token whose cumulative probability reaches u * total (u: counter 0 of
    (seed, step)); and whether some cumulative value lies within rounding of the target."""
    u = float(counter_uniforms([seed], [step], 1)[0, 0])
    cdf, acc = [], 0.0
    for q in _softmax(x):
        acc += q
        cdf.append(acc)
    target = u * cdf[-1]
    near = any(abs(c - target) < _MARGIN for c in cdf)
    return next(i for i, c in enumerate(cdf) if c >= target), near


_GRID = st.integers(-16, 16).map(lambda n: n / 2)


@st.composite
def _batch(draw: st.DrawFn, max_vocab: int = 12) -> tuple[torch.Tensor, list[SamplingRow]]:
    vocab = draw(st.integers(1, max_vocab))
    n = draw(st.integers(1, 4))
    logits = torch.tensor([[draw(_GRID) for _ in range(vocab)] for _ in range(n)])
    ids = st.integers(-1, vocab + 1)  # NOTE: ids the logits cannot express are ignored
    rows = []
    for _ in range(n):
        bias = draw(st.dictionaries(st.integers(0, vocab - 1),
                                    st.sampled_from([-100.0, -1.5, 0.5, 3.0, 100.0]),
                                    max_size=3))
        output = draw(st.lists(ids, max_size=3))
        # NOTE: min_tokens on either side of the output's length and at it (the EOS ban's edge)
        params = SamplingParams(
            temperature=draw(st.sampled_from([0.0, 1.0, 0.5, 2.0, 0.25])),
            top_k=draw(st.sampled_from([0, 0, 1, 2, 3, vocab, vocab + 1])),
            top_p=draw(st.sampled_from([1.0, 1.0, 0.9, 0.5, 0.3])),
            min_p=draw(st.sampled_from([0.0, 0.0, 0.2, 0.6, 1.0])),
            repetition_penalty=draw(st.sampled_from([1.0, 2.0, 0.5])),
            frequency_penalty=draw(st.sampled_from([0.0, 0.25, -0.5, 1.0])),
            presence_penalty=draw(st.sampled_from([0.0, 0.5, -0.25])),
            logit_bias=bias, min_tokens=max(0, len(output) + draw(st.integers(-1, 1))),
            logprobs=draw(st.sampled_from([None, 0, 1, 3, 20])))
        mask = draw(st.none() | st.lists(st.booleans(), min_size=vocab, max_size=vocab).map(
            lambda m: torch.tensor(m, dtype=torch.bool)))
        rows.append(SamplingRow(params, draw(st.integers(0, 2**64 - 1)), draw(st.integers(0, 50)),
                                draw(st.lists(ids, max_size=4)), output,
                                frozenset(draw(st.lists(ids, min_size=1, max_size=2))), mask))
    return logits, rows


def _check_decision(d: TokenDecision, raw: list[float], ref: _Ref, r: SamplingRow) -> None:
    lse = math.log(sum(math.exp(v) for v in raw))
    if r.params.is_greedy:
        assert d.token_id == _first_argmax(ref.processed) and d.greedy
    else:
        want, near = _draw_reference(ref.processed, r.seed, r.step)
        assert not d.greedy
        if not near:
            assert d.token_id == want
    assert ref.processed[d.token_id] > -_INF  # NOTE: never a removed token
    assert d.logprob == pytest.approx(raw[d.token_id] - lse, abs=1e-5)
    # NOTE: the sampler's float32 softmax works on the processed logits, whose rounding is
    # relative to their size (a +100 bias at temperature 0.25 makes 400: one float32 ulp there
    # is 3e-5 of a logprob); the bound is the float32 error of the largest processed logit
    big = max(abs(v) for v in ref.processed if v > -_INF)
    assert d.prob == pytest.approx(_softmax(ref.processed)[d.token_id],
                                   abs=1e-5 + 4 * big * 2.0 ** -23)
    k = min(r.params.logprobs or 0, len(raw))
    # NOTE: the k best by (logit descending, id ascending): the greedy pick's tie rule
    want_ids = sorted(range(len(raw)), key=lambda t: (-raw[t], t))[:k]
    assert [t for t, _ in d.top_logprobs] == want_ids
    for t, lp in d.top_logprobs:
        assert lp == pytest.approx(raw[t] - lse, abs=1e-5)
        if t == d.token_id:  # NOTE: one value for one token, to the bit (O1)
            assert lp == d.logprob


@settings(deadline=None, max_examples=examples(300))
@given(batch=_batch())
@example(batch=(torch.tensor([[1.0, 2.0, 2.0, 0.0]]),
                [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), 0, 0, [], [],
                             frozenset())]))
def test_t4_o1_sample_and_process_equal_the_brute_force_reference(
        batch: tuple[torch.Tensor, list[SamplingRow]]) -> None:
    """T4, O1: for all rows, ``process`` is the float64 pipeline by definition (exactly, on
    the grid), ``sample`` picks the first maximal token of it for a greedy row and the
    inverse-CDF token of counter 0 of (seed, step) for a sampled one; ``logprob`` and
    ``top_logprobs`` are log_softmax of the raw logits, ``prob`` the processed softmax's; a row
    with nothing allowed is a ModelError (L5). Each row alone decides the same (T4)."""
    logits, rows = batch
    try:
        refs = [_reference(logits[i].tolist(), r) for i, r in enumerate(rows)]
    except _Dead:
        with pytest.raises(ModelError):
            SAMPLER.process(logits, rows)
        with pytest.raises(ModelError):
            SAMPLER.sample(logits, rows)
        return
    assume(not any(ref.near_boundary for ref in refs))
    processed = SAMPLER.process(logits, rows)
    assert processed.dtype == torch.float32
    for i, ref in enumerate(refs):
        assert processed[i].tolist() == ref.processed
    decisions = SAMPLER.sample(logits, rows)
    assert len(decisions) == len(rows)
    for i, (d, ref, r) in enumerate(zip(decisions, refs, rows, strict=True)):
        _check_decision(d, logits[i].tolist(), ref, r)
        (alone,) = SAMPLER.sample(logits[i:i + 1], [r])
        assert (alone.token_id, alone.logprob, alone.prob, alone.greedy, alone.top_logprobs) == \
            (d.token_id, d.logprob, d.prob, d.greedy, d.top_logprobs)


@settings(deadline=None, max_examples=examples(40))
@given(batch=_batch(max_vocab=700))
def test_t4_large_vocabularies_cross_the_top_p_window(
        batch: tuple[torch.Tensor, list[SamplingRow]]) -> None:
    """T4: the same reference over vocabularies beyond the top-p window (256 tokens), where a
    nucleus may reach past it and the floor is found again over the whole row."""
    logits, rows = batch
    try:
        refs = [_reference(logits[i].tolist(), r) for i, r in enumerate(rows)]
    except _Dead:
        return
    assume(not any(ref.near_boundary for ref in refs))
    processed = SAMPLER.process(logits, rows)
    for i, ref in enumerate(refs):
        assert processed[i].tolist() == ref.processed


def test_l5_o1_score_refuses_logits_that_do_not_match_the_tokens() -> None:
    """L5: a scored row per token or a ModelError: more rows than tokens (which a gather
    would silently cut), a 1-D row, no rows at all for tokens; no tokens scores nothing."""
    for logits, tokens in [(torch.zeros(2, 5), [1]), (torch.zeros(5), [1, 2, 3, 4, 0]),
                           (torch.zeros(0, 5), [1]), (torch.zeros(1, 2, 5), [1])]:
        with pytest.raises(ModelError):
            SAMPLER.score(logits, tokens, 1)
    assert SAMPLER.score(torch.zeros(0, 5), [], 2) == []
    (one,) = SAMPLER.score(torch.tensor([[0.0, math.log(3.0)]]), [1], 1)
    assert one.prob == pytest.approx(0.75) and one.top_logprobs == ((1, pytest.approx(
        math.log(0.75))),)


def test_l5_nan_hidden_by_the_mask_is_still_a_model_error() -> None:
    """L5: a NaN logit is a model failure even where the grammar's mask would drop the token
    (the row's maximum after masking cannot see it): both ``process`` and ``sample`` refuse;
    a batch's rows must match its logits even when the logits have no rows."""
    logits = torch.tensor([[0.5, math.nan, 1.0]])
    r = SamplingRow(SamplingParams(), 0, 0, [], [], frozenset(),
                    torch.tensor([True, False, True]))
    for call in (SAMPLER.process, SAMPLER.sample):
        with pytest.raises(ModelError, match="NaN"):
            call(logits, [r])
    with pytest.raises(ModelError):
        SAMPLER.sample(torch.zeros(0, 3), [r])


def test_t4_top_k_in_a_batch_of_other_ks_keeps_its_own_k() -> None:
    """T4: a row's top-k does not depend on its neighbours' (the window is the batch's
    widest); a top-k past a one-token vocabulary keeps the token."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    rows = [SamplingRow(SamplingParams(top_k=k, top_p=p), 0, 0, [], [], frozenset())
            for k, p in [(2, 1.0), (4, 1.0), (1, 0.9)]]
    kept = torch.isfinite(SAMPLER.process(logits, rows)).sum(-1).tolist()
    assert kept == [2, 4, 1]
    # NOTE: top-k alone in the whole batch (no mass to add up): the k-th value read directly
    kept = torch.isfinite(SAMPLER.process(logits[:2], rows[:2])).sum(-1).tolist()
    assert kept == [2, 4]
    greedy = SAMPLER.process(logits[:1], [SamplingRow(SamplingParams(temperature=0.7, top_k=1),
                                                      0, 0, [], [], frozenset())])
    assert torch.isfinite(greedy).sum().item() == 1  # NOTE: top_k=1 alone truncates too
    one = SAMPLER.process(torch.tensor([[0.5]]), [SamplingRow(SamplingParams(top_k=2), 0, 0,
                                                              [], [], frozenset())])
    assert one.tolist() == [[0.5]]


def test_l5_t4_mask_shape_nan_message_and_a_lone_temperature() -> None:
    """L5: a mask of the wrong shape (even one that would broadcast) and a NaN logit are
    ModelErrors saying so; T4: a batch whose only row has temperature 2 is divided by it."""
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    for mask in (torch.tensor([True]), torch.tensor([True, True, True, True])):
        r = SamplingRow(SamplingParams(), 0, 0, [], [], frozenset(), mask)
        with pytest.raises(ModelError, match="mask shape"):
            SAMPLER.process(logits, [r])
    plain = SamplingRow(SamplingParams(temperature=2.0), 0, 0, [], [], frozenset())
    with pytest.raises(ModelError, match="NaN"):
        SAMPLER.sample(torch.tensor([[0.0, math.nan]]), [plain])
    assert SAMPLER.process(logits, [plain]).tolist() == [[0.5, 1.0, 1.5]]
