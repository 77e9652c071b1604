"""SamplingParams validation (request rejected with a named field, D1 style) and normalisation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from coda.errors import ErrorCode, InvalidRequestError
from coda.sampling import SamplingParams


def test_defaults_are_neutral_and_not_greedy() -> None:
    params = SamplingParams()
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.top_k == 0
    assert params.min_p == 0.0 and params.repetition_penalty == 1.0
    assert params.logit_bias == () and params.seed is None and params.logprobs is None
    assert not params.is_greedy


def test_is_greedy_for_temperature_zero_or_top_k_one() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1.3, top_k=1).is_greedy
    assert SamplingParams(temperature=1e-7).is_greedy  # would overflow float32 logits
    assert not SamplingParams(temperature=0.01, top_k=2).is_greedy


def test_integers_are_stored_as_floats_and_top_k_minus_one_means_off() -> None:
    params = SamplingParams(temperature=1, top_p=1, top_k=-1)
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert params.top_k == 0
    assert params == SamplingParams(top_k=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.01}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
        ({"logit_bias": [(3, 1.0), (3, 2.0)]}, "logit_bias"),
        ({"logit_bias": [(3,)]}, "logit_bias"),
        ({"logit_bias": 7}, "logit_bias"),
        ({"seed": 1.5}, "seed"),
        ({"seed": False}, "seed"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
    ],
)
def test_invalid_values_raise_invalid_request_naming_the_field(
    kwargs: dict[str, Any], field: str
) -> None:
    """D1 style: an invalid request is rejected with a typed error that names its field."""
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert info.value.code is ErrorCode.INVALID_REQUEST
    assert field in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0}, {"temperature": 100.0}, {"top_p": 1e-9}, {"top_k": 1},
        {"min_p": 1.0}, {"repetition_penalty": 1e-3}, {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0}, {"logit_bias": {0: -100, 1: 100}}, {"seed": -(2**70)},
        {"min_tokens": 0}, {"ignore_eos": True}, {"logprobs": 0}, {"logprobs": 20},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, Any]) -> None:
    SamplingParams(**kwargs)


def test_logit_bias_is_normalised_to_a_sorted_hashable_tuple() -> None:
    from_json = SamplingParams(logit_bias={"50": -100, "7": 2.5})
    from_pairs = SamplingParams(logit_bias=((7, 2.5), (50, -100.0)))
    assert from_json.logit_bias == ((7, 2.5), (50, -100.0))
    assert all(isinstance(b, float) for _, b in from_json.logit_bias)
    assert from_json == from_pairs and hash(from_json) == hash(from_pairs)


def test_params_are_frozen() -> None:
    params = SamplingParams()
    with pytest.raises(AttributeError):
        params.temperature = 0.5  # type: ignore[misc]


def test_validate_for_vocab_checks_logit_bias_ids() -> None:
    params = SamplingParams(logit_bias={9: 1.0, 3: -1.0})
    params.validate_for_vocab(10)
    with pytest.raises(InvalidRequestError) as info:
        params.validate_for_vocab(9)
    assert info.value.field == "logit_bias" and "9" in str(info.value)


def test_sampling_module_does_not_import_torch() -> None:
    """The core modules import neither torch nor the server (STYLE import direction)."""
    code = "import sys, coda.sampling; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert result.returncode == 0, result.stderr
