"""The Python API's bad input is a typed refusal, never a TypeError or a silent misreading
(README "Python API": bad input raises ``coda.errors.InvalidRequestError`` with ``.field``
before anything is queued; the one home is :func:`coda.engine.plan.plan_request`; SPEC L4,
L5, S1, G3). Found by the CLI/API acceptance sweep: ``max_tokens=2.5`` ran, ``max_tokens="5"``
and a text prompt were TypeErrors, and ``stop="Paris"`` stopped at any of its letters."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from coda.engine.plan import ModelLimits, plan_request
from coda.engine.types import GenerationRequest
from coda.errors import InvalidRequestError
from coda.sampling import SamplingParams

LIMITS = ModelLimits(context_length=64, vocab_size=100, eos_token_ids=frozenset({2}))


def _field_of_refusal(req: Any) -> str | None:
    with pytest.raises(InvalidRequestError) as err:
        plan_request(req, LIMITS)
    return err.value.field


@pytest.mark.parametrize("max_tokens", [2.5, "5", True], ids=["float", "str", "bool"])
def test_l4_max_tokens_must_be_an_integer(max_tokens: Any) -> None:
    """L4: the budget is a count: a float, a string or a bool is refused naming max_tokens."""
    assert _field_of_refusal(GenerationRequest((5, 6), max_tokens=max_tokens)) == "max_tokens"


@pytest.mark.parametrize("prompt", ["hello", b"hi", 5, (1.5, 6), ("a",), (True, 6)],
                         ids=["text", "bytes", "int", "float-id", "str-id", "bool-id"])
def test_l5_the_prompt_must_be_integer_token_ids(prompt: Any) -> None:
    """L5: the prompt is a sequence of integer ids; anything else is refused naming prompt."""
    assert _field_of_refusal(GenerationRequest(prompt, max_tokens=4)) == "prompt"


def test_s1_a_bare_string_is_not_a_tuple_of_stop_strings() -> None:
    """S1: ``stop="Paris"`` is refused, not read as the stops P, a, r, i, s."""
    assert _field_of_refusal(GenerationRequest((5, 6), max_tokens=4, stop="Paris")) == "stop"


@pytest.mark.parametrize("deadline", ["5", True], ids=["str", "bool"])
def test_g3_the_deadline_must_be_a_number_of_seconds(deadline: Any) -> None:
    assert _field_of_refusal(GenerationRequest((5, 6), max_tokens=4,
                                               deadline_s=deadline)) == "deadline"


def test_sampling_must_be_sampling_params() -> None:
    assert _field_of_refusal(GenerationRequest((5, 6), None, max_tokens=4)) == "sampling"


def test_numpy_ints_and_sequences_are_accepted_as_python_ints() -> None:
    """What is refused above is only what is wrong: numpy ids and a list prompt still plan."""
    plan = plan_request(GenerationRequest(list(np.array([5, 6], dtype=np.int64)),
                                          SamplingParams(), max_tokens=np.int64(4),
                                          stop=["x"], deadline_s=1), LIMITS)
    assert (plan.prompt_token_ids, plan.max_tokens, plan.stop_strings) == ((5, 6), 4, ("x",))


def test_l5_a_text_prompt_is_told_to_encode_it() -> None:
    """L5: text is not read as characters: the refusal says to encode it first."""
    with pytest.raises(InvalidRequestError, match="not text"):
        plan_request(GenerationRequest("hello", max_tokens=4), LIMITS)
