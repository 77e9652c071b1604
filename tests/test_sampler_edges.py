"""Sampler edge cases found by fuzzing the HTTP API (schemathesis): extreme but valid
parameters never crash the engine (issue 4 item 5: no bad input produces a 5xx)."""

from __future__ import annotations

import pytest
import torch

from coda.engine.sampler import Sampler, SamplingRow
from coda.sampling import SamplingParams


@pytest.mark.parametrize("top_p", [1e-50, 5e-324, 1e-45])
def test_tiny_top_p_that_underflows_float32_keeps_the_best_token(top_p: float) -> None:
    x = torch.randn(3, 219, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(top_p=top_p, seed=i), i, 0, [1], [], frozenset())
            for i in range(3)]
    got = [d.token_id for d in Sampler().sample(x.clone(), rows)]
    assert got == x.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [1e-5 * 1.0001, 1e-4, 100.0])
def test_extreme_temperatures_choose_a_valid_token(temperature: float) -> None:
    x = torch.randn(2, 219, generator=torch.Generator().manual_seed(1)) * 30
    rows = [SamplingRow(SamplingParams(temperature=temperature, top_p=0.5, top_k=3, min_p=0.9,
                                       seed=7), 7, s, [1], [], frozenset()) for s in range(2)]
    for d in Sampler().sample(x.clone(), rows):
        assert 0 <= d.token_id < 219
