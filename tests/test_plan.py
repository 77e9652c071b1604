"""Admission's one plan (issue 22 step 1; SPEC L4, S1, G3, K3): the token budget's one
derivation and check, against a brute-force oracle, and the plan's rules as the per-token
checks' OutputSpec."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from coda.engine.plan import NO_LIMIT, ModelLimits, claimed_tokens, fits_context, plan_request
from coda.engine.types import GenerationRequest
from coda.errors import ContextLengthExceededError, InvalidRequestError
from coda.finish import FinishReason
from coda.output import OutputSpec
from coda.sampling import SamplingParams
from tests.conftest import examples

LIMITS = ModelLimits(context_length=64, vocab_size=100, eos_token_ids=frozenset({2}),
                     max_stop_strings=2, max_stop_string_bytes=8)


def oracle(prompt_len: int, asked: int | None, default: int | None,
           context: int, min_tokens: int = 0) -> tuple[int, bool] | str:
    """The budget as the docs state it: what was asked (never below an asked ``min_tokens``);
    else the default where it ends before the context; else up to the context (then it ends
    context_limit, L4); ``NO_LIMIT`` (-1, Ollama's unset ``num_predict``) up to the context
    whatever the default, context_limit too."""
    room = context - prompt_len
    if room < 0 or (room == 0 and asked != 0):  # NOTE: scoring only may fill the context
        return "prompt"
    if asked == NO_LIMIT:  # NOTE: a protocol's no limit: the room, whatever the default
        return (room, True)
    if asked is not None:
        # NOTE: 0 prefills only (prompt scoring): the request ends max_output_tokens, no token
        if asked < 0 or asked > room:
            return "max_tokens"
        return "min_tokens" if min_tokens > asked else (asked, False)
    if default is not None and 1 <= default < room:
        return (default, False)
    return (room, True)


@settings(deadline=None, max_examples=examples(300))
@given(prompt_len=st.integers(1, 70), asked=st.none() | st.integers(-2, 80),
       default=st.none() | st.integers(1, 80), min_tokens=st.integers(0, 80))
@example(prompt_len=64, asked=0, default=None, min_tokens=0)  # NOTE: scoring fills the context
@example(prompt_len=64, asked=1, default=None, min_tokens=0)
@example(prompt_len=64, asked=None, default=None, min_tokens=0)
@example(prompt_len=65, asked=0, default=None, min_tokens=0)
def test_l4_budget_matches_oracle(prompt_len: int, asked: int | None,
                                  default: int | None, min_tokens: int) -> None:
    """L4: one derivation of max_tokens (the engine's default from its limits); a context-bound
    plan's budget is the room the context leaves and ends context_limit, never
    max_output_tokens (the per-token checks compare with this one number); an asked budget below the asked min_tokens is refused."""
    req = GenerationRequest(tuple([5] * prompt_len), SamplingParams(min_tokens=min_tokens),
                            max_tokens=asked)
    limits = replace(LIMITS, default_max_tokens=default)
    want = oracle(prompt_len, asked, default, LIMITS.context_length, min_tokens)
    if isinstance(want, str):
        with pytest.raises((InvalidRequestError, ContextLengthExceededError)) as err:
            plan_request(req, limits)
        assert err.value.field == want
        return
    plan = plan_request(req, limits)
    max_tokens, context_bound = want
    assert plan.max_tokens == max_tokens
    assert plan.max_total_tokens <= LIMITS.context_length
    assert isinstance(plan, OutputSpec)  # NOTE: the plan is its per-token rules (one object)
    assert plan.budget_end is (FinishReason.CONTEXT_LIMIT if context_bound
                               else FinishReason.MAX_OUTPUT_TOKENS)


@settings(deadline=None, max_examples=examples(200))
@given(prompt_len=st.integers(1, 70), asked=st.none() | st.integers(-2, 80))
@example(prompt_len=64, asked=0)
@example(prompt_len=64, asked=1)
@example(prompt_len=65, asked=0)
@example(prompt_len=63, asked=1)
@example(prompt_len=63, asked=2)
def test_l4_fits_context_is_the_plans_context_rule(prompt_len: int, asked: int | None) -> None:
    """L4: ``fits_context`` (what Responses ``truncation: "auto"`` cuts by) admits exactly the
    prompts and budgets the plan does not refuse for the context: room after the prompt, an
    asked budget within it, and a scoring request (``max_tokens: 0``) filling it whole."""
    req = GenerationRequest(tuple([5] * prompt_len), max_tokens=asked)
    try:
        plan_request(req, LIMITS)
        refused = False
    except ContextLengthExceededError:
        refused = True
    except InvalidRequestError:
        return  # NOTE: refused for another rule (a negative budget), which fits_context leaves
    assert fits_context(prompt_len, asked, LIMITS.context_length) is not refused
    # NOTE: a budget that is no integer is the plan's own 400, never a cut
    assert fits_context(prompt_len, "16", LIMITS.context_length) is (prompt_len < 64)  # type: ignore[arg-type]


def test_claimed_tokens_is_the_asked_budget_else_the_default() -> None:
    """A router's estimate (coda.scaleout.remote) of an unplanned request's budget."""
    assert claimed_tokens(GenerationRequest((5,), max_tokens=7), 32) == 7
    assert claimed_tokens(GenerationRequest((5,)), 32) == 32
    assert claimed_tokens(GenerationRequest((5,), max_tokens=NO_LIMIT), 32) == 32


def test_plan_checks_each_field_naming_it() -> None:
    """S1, G3, K3 and the vocabulary: each bad field is refused by the plan, naming it."""
    bad = {
        "prompt": GenerationRequest((), max_tokens=1),
        "stop": GenerationRequest((5,), stop=("a", "b", "c")),
        "stop_token_ids": GenerationRequest((5,), stop_token_ids=((100,),)),
        "logit_bias": GenerationRequest((5,), sampling=SamplingParams(logit_bias={100: 1.0})),
        "utf8_tail": GenerationRequest((5,), utf8_tail="keep"),
        "deadline": GenerationRequest((5,), deadline_s=0.0),
    }
    for field, req in bad.items():
        with pytest.raises(InvalidRequestError) as err:
            plan_request(req, LIMITS)
        assert err.value.field == field
    with pytest.raises(InvalidRequestError):
        plan_request(GenerationRequest((5,), stop=("x" * 9,)), LIMITS)


def test_plan_is_frozen_and_fixes_the_seed() -> None:
    """E: a request without a seed gets one drawn at planning, fixed for its whole life."""
    plan = plan_request(GenerationRequest((5, 6), max_tokens=3, request_id="r"), LIMITS)
    assert plan.request_id == "r" and isinstance(plan.seed, int)
    with pytest.raises(AttributeError):
        plan.max_tokens = 4  # type: ignore[misc]
    seeded = plan_request(GenerationRequest((5,), sampling=SamplingParams(seed=7)), LIMITS)
    assert seeded.seed == 7


def test_require_budget_is_the_budgets_check_after_planning() -> None:
    """Issue 13 through the plan: a need past the budget is refused naming max_tokens; a need
    that fits (the boundary included) passes."""
    plan = plan_request(GenerationRequest((5,), max_tokens=4), LIMITS)
    plan.require_budget(4, "the grammar: its shortest known completion needs")
    with pytest.raises(InvalidRequestError) as err:
        plan.require_budget(5, "the grammar: its shortest known completion needs")
    assert err.value.field == "max_tokens"
    assert "max_tokens (4) is too small for the grammar" in err.value.message
