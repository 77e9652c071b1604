"""Admission's checks field by field, at their boundaries (issue 22 step 1; SPEC L4, L5, S1,
G3, K3, E): what :func:`coda.engine.plan.plan_request` accepts on each side of every bound, that
the plan carries each field of the request unchanged, the reasoning budget's checks, and an
embedding input's. A mutation run of ``coda/engine/plan.py`` (``scripts/mutation.sh
engine/plan``) found these boundaries untested: 40 of 97 mutants survived ``tests/test_plan.py``
alone."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.early_stop import EarlyStopPolicy
from coda.engine.plan import NO_LIMIT, ModelLimits, check_embedding_input, plan_request
from coda.engine.types import GenerationRequest, GrammarSpec
from coda.errors import ContextLengthExceededError, InvalidRequestError
from coda.finish import FinishReason
from coda.reasoning import ReasoningSpec
from coda.sampling import MAX_LOGPROBS, SamplingParams
from coda.stream_backpressure import BackpressureConfig
from tests.conftest import examples

LIMITS = ModelLimits(context_length=64, vocab_size=100, eos_token_ids=frozenset({2, 3}),
                     max_stop_strings=2, max_stop_string_bytes=8)


def refused(req: GenerationRequest, limits: ModelLimits = LIMITS) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as err:
        plan_request(req, limits)
    return err.value


def test_l5_prompt_ids_are_checked_against_the_vocabulary_at_both_ends() -> None:
    """L5: ids 0 and vocab-1 pass; -1 and vocab are refused naming ``prompt``."""
    assert plan_request(GenerationRequest((0, 99)), LIMITS).prompt_token_ids == (0, 99)
    for bad in ((5, 100), (-1, 5)):
        err = refused(GenerationRequest(bad))
        assert err.field == "prompt" and "[0, 100)" in err.message
    assert refused(GenerationRequest(())).message == "the prompt is empty"


def test_l4_a_prompt_that_fills_the_context_is_refused_naming_the_prompt() -> None:
    """L4: room 0 (prompt == context) is refused; one token less leaves a budget of 1."""
    with pytest.raises(ContextLengthExceededError) as err:
        plan_request(GenerationRequest((5,) * 64), LIMITS)
    assert err.value.field == "prompt" and "64 tokens" in err.value.message
    plan = plan_request(GenerationRequest((5,) * 63), LIMITS)
    assert (plan.max_tokens, plan.budget_end) == (1, FinishReason.CONTEXT_LIMIT)


def test_l4_the_asked_budget_at_the_context_passes_and_one_more_is_refused() -> None:
    plan = plan_request(GenerationRequest((5,) * 4, max_tokens=60), LIMITS)
    assert plan.max_tokens == 60 and plan.max_total_tokens == 64
    assert plan.budget_end is FinishReason.MAX_OUTPUT_TOKENS
    with pytest.raises(ContextLengthExceededError) as err:
        plan_request(GenerationRequest((5,) * 4, max_tokens=61), LIMITS)
    assert err.value.field == "max_tokens"
    assert "(4) + max_tokens (61) exceeds the context (64)" in err.value.message
    zero = plan_request(GenerationRequest((5,), max_tokens=0), LIMITS)
    assert zero.max_tokens == 0  # NOTE: prompt scoring: prefill only
    for bad in (-2, True):
        err2 = refused(GenerationRequest((5,), max_tokens=bad))  # type: ignore[arg-type]
        assert err2.field == "max_tokens" and ">= 0" in err2.message
    # NOTE: NO_LIMIT (-1): a protocol's no limit, the room the context leaves (context_limit)
    unlimited = plan_request(GenerationRequest((5,) * 4, max_tokens=NO_LIMIT),
                             replace(LIMITS, default_max_tokens=8))
    assert (unlimited.max_tokens, unlimited.budget_end) == (60, FinishReason.CONTEXT_LIMIT)


def test_l4_min_tokens_equal_to_the_budget_passes_and_above_it_is_refused() -> None:
    ok = plan_request(GenerationRequest((5,), SamplingParams(min_tokens=3), max_tokens=3),
                      LIMITS)
    assert ok.min_tokens == 3
    err = refused(GenerationRequest((5,), SamplingParams(min_tokens=4), max_tokens=3))
    assert err.field == "min_tokens" and "min_tokens (4)" in err.message


def test_l4_a_default_budget_of_exactly_the_room_is_context_bound() -> None:
    """The default applies only where it ends *before* the context: equal to the room, the
    request is bounded by the context and ends ``context_limit`` (L4)."""
    limits = replace(LIMITS, default_max_tokens=63)
    at_room = plan_request(GenerationRequest((5,)), limits)
    assert (at_room.max_tokens, at_room.budget_end) == (63, FinishReason.CONTEXT_LIMIT)
    below = plan_request(GenerationRequest((5, 5)), replace(LIMITS, default_max_tokens=61))
    assert (below.max_tokens, below.budget_end) == (61, FinishReason.MAX_OUTPUT_TOKENS)
    one = plan_request(GenerationRequest((5,)), replace(LIMITS, default_max_tokens=1))
    assert (one.max_tokens, one.budget_end) == (1, FinishReason.MAX_OUTPUT_TOKENS)


def test_s1_stop_strings_up_to_the_bounds_pass_and_past_them_are_refused() -> None:
    """S1: as many stop strings as allowed, each as long as allowed (in UTF-8 bytes) pass."""
    ok = plan_request(GenerationRequest((5,), stop=("a" * 8, "é" * 4)), LIMITS)
    assert ok.stop_strings == ("a" * 8, "é" * 4)
    err = refused(GenerationRequest((5,), stop=("a", "b", "c")))
    assert err.field == "stop" and err.message == "at most 2 stop strings"
    for long in ("a" * 9, "é" * 4 + "a"):  # NOTE: 9 bytes each: bytes are counted, not chars
        err = refused(GenerationRequest((5,), stop=(long,)))
        assert err.field == "stop" and "1..8 bytes" in err.message


def test_s1_stop_token_ids_are_non_empty_and_in_the_vocabulary() -> None:
    ok = plan_request(GenerationRequest((5,), stop_token_ids=((0,), (99, 98))), LIMITS)
    assert ok.stop_token_ids == ((0,), (99, 98))
    for bad in (((),), ((-1,),), ((5, 100),)):
        err = refused(GenerationRequest((5,), stop_token_ids=bad))
        assert err.field == "stop_token_ids"


def test_logit_bias_is_checked_against_the_vocabulary() -> None:
    ok = plan_request(GenerationRequest((5,), SamplingParams(logit_bias={99: 1.0})), LIMITS)
    assert ok.sampling == SamplingParams(logit_bias={99: 1.0})
    assert refused(GenerationRequest((5,), SamplingParams(logit_bias={100: 1.0}))
                   ).field == "logit_bias"


def test_prompt_logprobs_from_zero_to_the_maximum_pass() -> None:
    for k in (0, MAX_LOGPROBS):
        assert plan_request(GenerationRequest((5,), prompt_logprobs=k), LIMITS
                            ).prompt_logprobs == k
    for bad in (-1, MAX_LOGPROBS + 1, True):
        err = refused(GenerationRequest((5,), prompt_logprobs=bad))
        assert err.field == "prompt_logprobs" and f"[0, {MAX_LOGPROBS}]" in err.message


def test_k3_each_tail_policy_passes_and_others_are_refused() -> None:
    for policy in ("auto", "fail", "drop"):
        assert plan_request(GenerationRequest((5,), utf8_tail=policy), LIMITS
                            ).utf8_tail == policy
    assert refused(GenerationRequest((5,), utf8_tail="keep")).field == "utf8_tail"


def test_g3_any_positive_deadline_passes() -> None:
    assert plan_request(GenerationRequest((5,), deadline_s=1e-9), LIMITS).deadline_s == 1e-9
    assert plan_request(GenerationRequest((5,)), LIMITS).deadline_s is None
    for bad in (0.0, -1.0, float("nan")):
        assert refused(GenerationRequest((5,), deadline_s=bad)).field == "deadline"


def test_reasoning_budget_checks_name_max_reasoning_tokens() -> None:
    """Issue 23: a budget is an integer >= 0 with a closer to force, inside the vocabulary."""
    good = ReasoningSpec(close_ids=(0, 99), budget_tokens=0)
    assert plan_request(GenerationRequest((5,), reasoning=good), LIMITS).reasoning == good
    no_budget = ReasoningSpec(close_ids=())  # NOTE: no budget needs no closer
    assert plan_request(GenerationRequest((5,), reasoning=no_budget), LIMITS).reasoning
    for bad, words in (
            (ReasoningSpec(close_ids=(7,), budget_tokens=-1), "integer >= 0"),
            (ReasoningSpec(close_ids=(7,), budget_tokens=True), "integer >= 0"),
            (ReasoningSpec(close_ids=(), budget_tokens=3), "no reasoning closer"),
            (ReasoningSpec(close_ids=(100,)), "outside the vocabulary"),
            (ReasoningSpec(close_ids=(-1,)), "outside the vocabulary")):
        err = refused(GenerationRequest((5,), reasoning=bad))
        assert err.field == "max_reasoning_tokens" and words in err.message


def test_the_plan_carries_every_field_of_the_request() -> None:
    """One object per request: every rule the request asked for reaches the plan unchanged."""
    grammar = GrammarSpec(regex="a+")
    policy = EarlyStopPolicy(1, 4, 1000, 0.9, False)
    pressure = BackpressureConfig(pause_bytes=10, max_bytes=20)
    req = GenerationRequest(
        (5, 6), SamplingParams(seed=9, min_tokens=1, ignore_eos=True), max_tokens=5,
        stop=("zz",), stop_token_ids=((7,),), include_stop_str_in_output=True,
        skip_special_tokens=False, deadline_s=2.5, early_stop=policy, grammar=grammar,
        backpressure=pressure, request_id="r-1", utf8_tail="drop", stops_end_at="<tool>",
        speculative=False, prompt_logprobs=2)
    plan = plan_request(req, LIMITS)
    assert (plan.request_id, plan.prompt_token_ids, plan.sampling, plan.seed) == (
        "r-1", (5, 6), req.sampling, 9)
    assert (plan.stop_strings, plan.stop_token_ids, plan.include_stop_str_in_output) == (
        ("zz",), ((7,),), True)
    assert (plan.skip_special_tokens, plan.utf8_tail, plan.stops_end_at) == (
        False, "drop", b"<tool>")
    assert (plan.min_tokens, plan.ignore_eos, plan.eos_token_ids) == (1, True, frozenset({2, 3}))
    assert (plan.grammar, plan.early_stop, plan.deadline_s, plan.backpressure) == (
        grammar, policy, 2.5, pressure)
    assert (plan.speculative, plan.prompt_logprobs, plan.limits) == (False, 2, LIMITS)
    defaults = plan_request(GenerationRequest((5,)), LIMITS)
    assert (defaults.stops_end_at, defaults.speculative, defaults.ignore_eos) == (b"", True, False)
    assert (defaults.include_stop_str_in_output, defaults.skip_special_tokens) == (False, True)


def test_e_an_unseeded_request_gets_its_own_63_bit_seed_and_id() -> None:
    """E: a seed is drawn per plan (two plans differ), in [0, 2**63); an id is made when none
    was given (``req-`` and 16 hex digits, unique)."""
    a, b = (plan_request(GenerationRequest((5,)), LIMITS) for _ in range(2))
    assert a.seed != b.seed and all(0 <= p.seed < 2 ** 63 for p in (a, b))
    assert a.request_id != b.request_id
    assert all(re.fullmatch(r"req-[0-9a-f]{16}", p.request_id) for p in (a, b))


@settings(deadline=None, max_examples=examples(200))
@given(n=st.integers(0, 70), context=st.integers(1, 64),
       ids=st.lists(st.integers(-2, 101), max_size=4), vocab=st.none() | st.just(100))
def test_embedding_input_matches_its_rule(n: int, context: int, ids: list[int],
                                          vocab: int | None) -> None:
    """An embedding's input: 1..context tokens, each in the vocabulary when it is known."""
    tokens = (ids + [5] * n)[:max(n, len(ids))]
    ok = (0 < len(tokens) <= context
          and (vocab is None or all(0 <= t < vocab for t in tokens)))
    if ok:
        check_embedding_input(tokens, context, vocab)
        return
    with pytest.raises(InvalidRequestError) as err:
        check_embedding_input(tokens, context, vocab)
    assert err.value.field == "input"


def test_embedding_input_messages_say_which_bound() -> None:
    with pytest.raises(InvalidRequestError, match="must not be empty"):
        check_embedding_input([], 8)
    with pytest.raises(InvalidRequestError, match="3 tokens exceed the model's context of 2"):
        check_embedding_input([1, 1, 1], 2)
    with pytest.raises(InvalidRequestError, match="out of the vocabulary"):
        check_embedding_input([1, 100], 8, 100)
    check_embedding_input([1, 1], 2, 100)
    check_embedding_input([0, 99], 2, 100)  # NOTE: both ends of the vocabulary


def test_l5_prediction_ids_are_checked_against_the_vocabulary_at_both_ends() -> None:
    """A prediction's token ids (OpenAI's predicted outputs, drafted as is) are ids of this
    vocabulary: 0 and vocab_size - 1 pass, vocab_size and -1 are refused naming the field."""
    plan_request(GenerationRequest((5,), prediction=(0, 99)), LIMITS)  # NOTE: admitted
    for bad in ((0, 100), (-1,), (1.0,)):
        assert refused(GenerationRequest((5,), prediction=bad)).field == "prediction"  # type: ignore[arg-type]


def test_l4_fits_context_is_the_plans_own_admission() -> None:
    """fits_context (Responses truncation cuts by it): room after the prompt, and an asked
    budget within it; exactly as plan_request admits or refuses."""
    from coda.engine.plan import fits_context

    for prompt_len, asked in ((63, None), (64, None), (63, 1), (63, 2), (4, 60), (4, 61),
                              (64, 0), (1, 0)):
        req = GenerationRequest((5,) * prompt_len, max_tokens=asked)
        try:
            plan_request(req, LIMITS)
            admitted = True
        except InvalidRequestError:
            admitted = False
        assert fits_context(prompt_len, asked, 64) is admitted, (prompt_len, asked)
