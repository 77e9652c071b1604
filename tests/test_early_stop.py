"""Tests of coda.early_stop (SPEC D1–D6), after the 12 tests of seed 004's reference module."""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import coda.early_stop as early_stop
from coda.early_stop import (
    EarlyStopController,
    EarlyStopDecision,
    EarlyStopPolicy,
    EarlyStopReason,
    approximate_output_tokens,
    evaluate_stop_economics,
)
from coda.early_stop_failure import StreamFailureReason, decide_stream_failure
from coda.errors import ErrorCode, InvalidRequestError
from tests.conftest import examples

R = EarlyStopReason


def policy(**overrides: Any) -> EarlyStopPolicy:
    fields: dict[str, Any] = {
        "min_tokens": 4,
        "max_tokens": 20,
        "deadline_ms": 1000,
        "confidence_threshold": 0.9,
        "no_retry_after_first_frame": True,
    }
    fields.update(overrides)
    return EarlyStopPolicy(**fields)


def by_tokens(p: EarlyStopPolicy) -> EarlyStopController:
    """A controller whose counter is one token per character (the reference tests' injection)."""
    return EarlyStopController(p, count_tokens=len)


# ------------------------------------------------------------------------------------ D1
@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"min_tokens": True}, "min_tokens"),  # bool is not an int here
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 20.0}, "max_tokens"),
        ({"deadline_ms": 0}, "deadline_ms"),
        ({"deadline_ms": "5"}, "deadline_ms"),
        ({"confidence_threshold": 1.01}, "confidence_threshold"),
        ({"confidence_threshold": -0.1}, "confidence_threshold"),
        ({"confidence_threshold": math.nan}, "confidence_threshold"),
        ({"confidence_threshold": math.inf}, "confidence_threshold"),
        ({"confidence_threshold": False}, "confidence_threshold"),
        ({"no_retry_after_first_frame": 1}, "no_retry_after_first_frame"),
        ({"require_closure": "yes"}, "require_closure"),
        ({"min_tokens": 21}, "min_tokens"),  # min_tokens > max_tokens
    ],
)
def test_d1_invalid_policy_is_rejected_naming_the_field(
    overrides: dict[str, Any], field: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        policy(**overrides)
    assert info.value.field == field
    assert info.value.code is ErrorCode.INVALID_REQUEST


def test_d1_policy_bounds_that_are_valid() -> None:
    p = policy(min_tokens=0, max_tokens=1, deadline_ms=1, confidence_threshold=0)
    assert p.require_closure is False
    assert policy(min_tokens=20, max_tokens=20, confidence_threshold=1).min_tokens == 20


def test_d1_from_dict_accepts_snake_and_camel_case_and_rejects_the_rest() -> None:
    camel = {
        "minTokens": 2,
        "maxTokens": 8,
        "deadlineMs": 500,
        "confidenceThreshold": 0.75,
        "noRetryAfterFirstFrame": False,
        "requireClosure": True,
    }
    snake = {
        "min_tokens": 2,
        "max_tokens": 8,
        "deadline_ms": 500,
        "confidence_threshold": 0.75,
        "no_retry_after_first_frame": False,
        "require_closure": True,
    }
    expected = EarlyStopPolicy(2, 8, 500, 0.75, False, True)
    assert EarlyStopPolicy.from_dict(camel) == expected
    assert EarlyStopPolicy.from_dict(snake) == expected
    mixed = {k: v for k, v in snake.items() if k != "require_closure"} | {"deadlineMs": 500}
    del mixed["deadline_ms"]
    assert EarlyStopPolicy.from_dict(mixed) == EarlyStopPolicy(2, 8, 500, 0.75, False)

    for bad, field in [
        ({**snake, "temperature": 1}, "temperature"),
        ({**snake, "maxTokens": 8}, "max_tokens"),  # both spellings
        ({k: v for k, v in snake.items() if k != "deadline_ms"}, "deadline_ms"),
        ({**camel, "maxTokens": -3}, "max_tokens"),
    ]:
        with pytest.raises(InvalidRequestError) as info:
            EarlyStopPolicy.from_dict(bad)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError):
        EarlyStopPolicy.from_dict([("min_tokens", 1)])  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ D2
def test_d2_confidence_stops_only_after_min_tokens() -> None:
    ctl = by_tokens(policy(min_tokens=4))
    first = ctl.on_delta("ab", 0.99, 10)
    assert first == EarlyStopDecision(False, R.CONTINUE, 2, 18)
    stop = ctl.on_delta("cd", 0.95, 20)
    assert stop == EarlyStopDecision(True, R.CONFIDENCE, 4, 16)
    assert ctl.state.first_frame_at_ms == 10 and ctl.state.stopped


def test_d2_low_confidence_continues_and_empty_delta_keeps_confidence() -> None:
    ctl = by_tokens(policy(min_tokens=0))
    assert ctl.on_delta("abc", 0.5, 5).reason is R.CONTINUE
    # An empty delta moves the clock but not the confidence or the first frame.
    assert ctl.on_delta("", 1.0, 6).reason is R.CONTINUE
    assert (ctl.state.confidence, ctl.state.elapsed_ms, ctl.state.tokens) == (0.5, 6, 3)
    assert ctl.on_tokens(0, 1.0, 7).reason is R.CONTINUE
    assert ctl.on_tokens(0, 1.0, 8, text="x").reason is R.CONFIDENCE


def test_d1_d2_require_closure_gates_the_confidence_stop() -> None:
    ctl = by_tokens(policy(min_tokens=1, require_closure=True))
    assert ctl.on_delta('{"a":', 0.99, 1).reason is R.CONTINUE
    ctl.mark_closed()
    assert ctl.state.closed
    assert ctl.on_delta("1}", 0.99, 2) == EarlyStopDecision(True, R.CONFIDENCE, 7, 13)


def test_d2_max_tokens_is_a_hard_budget_even_with_low_confidence() -> None:
    ctl = by_tokens(policy(max_tokens=5, min_tokens=0))
    assert ctl.on_delta("abc", 0.1, 1).reason is R.CONTINUE
    assert ctl.on_delta("defg", 0.1, 2) == EarlyStopDecision(True, R.MAX_TOKENS, 7, 0)


def test_d2_deadline_beats_max_tokens_and_confidence() -> None:
    ctl = by_tokens(policy(max_tokens=5, min_tokens=0, confidence_threshold=0.5, deadline_ms=100))
    assert ctl.on_delta("abcdef", 1.0, 100) == EarlyStopDecision(True, R.DEADLINE, 6, 0)
    heartbeat = by_tokens(policy(deadline_ms=100))
    assert heartbeat.on_delta("", 0.0, 150).reason is R.DEADLINE


def test_d2_user_cancel_wins_and_records_its_reason() -> None:
    ctl = by_tokens(policy())
    ctl.on_delta("ab", 0.1, 10)
    decision = ctl.cancel("client-disconnect")
    assert decision == EarlyStopDecision(True, R.USER_CANCEL, 2, 18)
    assert ctl.state.cancelled and ctl.state.cancel_reason == "client-disconnect"
    # Later deltas, even past the deadline and the budget, return the cancel.
    assert ctl.on_delta("x" * 50, 1.0, 5000) is decision
    assert by_tokens(policy()).cancel().reason is R.USER_CANCEL


def test_d2_first_stopping_decision_is_final() -> None:
    ctl = by_tokens(policy(min_tokens=0, confidence_threshold=0.5))
    stop = ctl.on_delta("a", 0.6, 1)
    assert stop.reason is R.CONFIDENCE
    assert ctl.cancel() is stop
    assert ctl.on_delta("bbbbbbbbbbbbbbbbbbbbbbbbb", 1.0, 10_000) is stop
    assert ctl.on_tokens(100, 1.0, 10_000) is stop
    assert ctl.state.tokens == 1 and ctl.decision is stop
    # Like the reference, a late cancel is still recorded in the state.
    assert ctl.state.cancelled


def test_d2_delta_arguments_are_validated() -> None:
    ctl = by_tokens(policy())
    bad_args: list[tuple[tuple[Any, ...], str]] = [
        (("a", 1.5, 0), "confidence"),
        (("a", math.nan, 0), "confidence"),
        (("a", 0.5, -1), "elapsed_ms"),
        (("a", 0.5, 1.0), "elapsed_ms"),
        ((None, 0.5, 1), "text"),
    ]
    for args, field in bad_args:
        with pytest.raises(InvalidRequestError) as info:
            ctl.on_delta(*args)
        assert info.value.field == field
    with pytest.raises(InvalidRequestError) as info:
        ctl.on_tokens(-1, 0.5, 0)
    assert info.value.field == "n_tokens"
    assert ctl.state.tokens == 0


def test_d3_default_counter_is_the_approximation() -> None:
    ctl = EarlyStopController(policy(min_tokens=0, confidence_threshold=1.0))
    assert ctl.on_delta("hello", 0.0, 1).committed_tokens == 2
    assert ctl.on_delta("你好", 0.0, 2).committed_tokens == 4


# ------------------------------------------------------------------------------------ D3
@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("", 0),
        ("a", 1),
        ("abcd", 1),
        ("abcde", 2),
        ("你好世界", 4),
        ("é", 1),  # U+00E9 > U+007F
        ("\x7f", 1),  # U+007F is ASCII: 1/4 rounds up to 1
        ("😀", 1),  # one code point, not two UTF-16 units
        ("hi 你好", 3),  # 3/4 + 2 -> 3
        ("a" * 400_001, 100_001),
    ],
)
def test_d3_token_approximation_cjk_and_ascii(text: str, tokens: int) -> None:
    assert approximate_output_tokens(text) == tokens


@settings(deadline=None, max_examples=examples(150))
@given(st.text(max_size=60))
def test_d3_approximation_is_the_ceiling_of_exact_quarters(text: str) -> None:
    from fractions import Fraction

    exact = sum(Fraction(1) if ord(c) > 0x7F else Fraction(1, 4) for c in text)
    assert approximate_output_tokens(text) == math.ceil(exact)


# ------------------------------------------------------------------------------------ D4
def test_d4_stop_economics_numbers() -> None:
    e = evaluate_stop_economics(200, 800, 0.9, 2, 3000)
    assert (e.saved_tokens, e.saved_micros, e.expected_loss_micros, e.net_micros) == (
        600,
        1200,
        300,
        900,
    )
    assert e.wrong_probability == 1 - 0.9
    assert e.break_even_confidence == 0.6 and e.worth_stopping

    # (1 - 0.7) * 1000 is 300.00000000000006 in doubles: the -1e-9 keeps the loss at 300.
    assert evaluate_stop_economics(0, 100, 0.7, 3, 1000).expected_loss_micros == 300
    # Net zero is not worth it; emitted past the expectation saves nothing.
    zero = evaluate_stop_economics(0, 150, 0.7, 2, 1000)
    assert (zero.net_micros, zero.worth_stopping) == (0, False)
    over = evaluate_stop_economics(900, 800, 0.99, 5, 1000)
    assert (over.saved_tokens, over.break_even_confidence, over.worth_stopping) == (0, 1.0, False)
    free = evaluate_stop_economics(1, 2, 0.0, 1, 0)
    assert (free.expected_loss_micros, free.break_even_confidence, free.worth_stopping) == (
        0,
        0.0,
        True,
    )


def test_d4_break_even_rounds_half_up_like_javascript() -> None:
    # 1 - 3/128 = 0.9765625 exactly: Math.round gives 0.976563, Python round() 0.976562.
    assert evaluate_stop_economics(0, 3, 0.5, 1, 128).break_even_confidence == 0.976563
    assert evaluate_stop_economics(0, 7, 0.5, 1, 128).break_even_confidence == 0.945313
    assert evaluate_stop_economics(0, 1, 0.5, 1, 3).break_even_confidence == 0.666667


def test_d4_economics_inputs_are_validated() -> None:
    bad_args: list[tuple[tuple[Any, ...], str]] = [
        ((-1, 1, 0.5, 1, 1), "emitted_tokens"),
        ((0, 1.5, 0.5, 1, 1), "expected_full_tokens"),
        ((0, 1, 0.5, True, 1), "micros_per_token"),
        ((0, 1, 0.5, 1, -5), "reask_cost_micros"),
        ((0, 1, 2.0, 1, 1), "confidence"),
    ]
    for args, field in bad_args:
        with pytest.raises(InvalidRequestError) as info:
            evaluate_stop_economics(*args)
        assert info.value.field == field


# ------------------------------------------------------------------------------------ D5
@pytest.mark.parametrize(
    ("first_frame", "retryable", "no_retry", "expected"),
    [
        (True, True, True, (False, StreamFailureReason.NO_RETRY_AFTER_FIRST_FRAME)),
        (True, False, True, (False, StreamFailureReason.NO_RETRY_AFTER_FIRST_FRAME)),
        (False, False, True, (False, StreamFailureReason.ERROR_NOT_RETRYABLE)),
        (True, False, False, (False, StreamFailureReason.ERROR_NOT_RETRYABLE)),
        (False, True, True, (True, StreamFailureReason.RETRY_ALLOWED)),
        (True, True, False, (True, StreamFailureReason.RETRY_ALLOWED)),
    ],
)
def test_d5_stream_failure_decision_bills_committed_tokens(
    first_frame: bool, retryable: bool, no_retry: bool, expected: tuple[bool, StreamFailureReason]
) -> None:
    d = decide_stream_failure(first_frame, retryable, no_retry, 37)
    assert (d.retryable, d.reason) == expected
    assert d.committed_tokens == 37


def test_d5_stream_failure_inputs_are_validated() -> None:
    with pytest.raises(InvalidRequestError) as info:
        decide_stream_failure(True, True, True, -1)
    assert info.value.field == "committed_tokens"
    with pytest.raises(InvalidRequestError) as info:
        decide_stream_failure(1, True, True, 0)  # type: ignore[arg-type]
    assert info.value.field == "first_frame_sent"


def test_d2_d5_reason_values_are_exactly_the_reference_strings() -> None:
    assert [r.value for r in EarlyStopReason] == [
        "continue",
        "confidence",
        "max-tokens",
        "deadline",
        "user-cancel",
    ]
    assert {r.value for r in StreamFailureReason} == {
        "retry-allowed",
        "no-retry-after-first-frame",
        "error-not-retryable",
    }


# ------------------------------------------------------------------------------------ D6
def test_d6_module_only_decides_it_imports_no_engine_server_or_io() -> None:
    """D6 structure: the policy modules (coda/early_stop.py and its parts, early_stop_*.py)
    decide only (no engine, server or I/O import). The behaviour, a stop taking the cancel
    path, is test_early_stop_engine.py's D6 tests."""
    paths = sorted(Path(early_stop.__file__).parent.glob("early_stop*.py"))
    assert len(paths) == 3
    for path in paths:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = {
            (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert imported <= {"__future__", "math", "collections.abc", "dataclasses", "enum",
                            "typing", "coda.errors", "coda.early_stop_checks"}, path  # fmt: skip


# ------------------------------------------------------------------------------ properties
policies = st.integers(1, 12).flatmap(
    lambda mx: st.builds(
        EarlyStopPolicy,
        min_tokens=st.integers(0, mx),
        max_tokens=st.just(mx),
        deadline_ms=st.integers(1, 60),
        confidence_threshold=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
        no_retry_after_first_frame=st.booleans(),
        require_closure=st.booleans(),
    )
)
confidences = st.sampled_from([0.0, 0.3, 0.5, 0.79, 0.8, 0.95, 1.0])
ops = st.lists(
    st.one_of(
        st.tuples(st.just("tokens"), st.integers(0, 4), confidences, st.integers(0, 80)),
        st.tuples(
            st.just("text"),
            st.sampled_from(["", "ab", "abcde", "中文"]),
            confidences,
            st.integers(0, 80),
        ),  # fmt: skip
        st.tuples(st.just("close")),
        st.tuples(st.just("cancel")),
    ),
    max_size=14,
)


@settings(deadline=None, max_examples=examples(200))
@given(policies, ops)
def test_d2_properties_finality_precedence_monotone_and_saved_bound(
    p: EarlyStopPolicy, script: list[tuple[Any, ...]]
) -> None:
    """D2: the first stop is final; cancel > deadline > max tokens > confidence; committed
    tokens never decrease; saved upper bound = max(0, max - committed)."""
    ctl = EarlyStopController(p)  # default D3 counter
    first_stop: EarlyStopDecision | None = None
    tokens, confidence, closed, last_committed = 0, 0.0, False, 0
    for op in script:
        if op[0] == "close":
            ctl.mark_closed()
            closed = True
            continue
        if op[0] == "cancel":
            decision = ctl.cancel()
            expected = R.USER_CANCEL
        else:
            kind, payload, conf, elapsed = op
            if kind == "tokens":
                decision = ctl.on_tokens(payload, conf, elapsed)
                n, has_output = payload, payload > 0
            else:
                decision = ctl.on_delta(payload, conf, elapsed)
                n, has_output = approximate_output_tokens(payload), payload != ""
            if first_stop is None and has_output:
                tokens, confidence = tokens + n, conf
            if elapsed >= p.deadline_ms:
                expected = R.DEADLINE
            elif tokens >= p.max_tokens:
                expected = R.MAX_TOKENS
            elif (
                tokens >= p.min_tokens
                and confidence >= p.confidence_threshold
                and (closed or not p.require_closure)
            ):
                expected = R.CONFIDENCE
            else:
                expected = R.CONTINUE
        if first_stop is not None:
            assert decision is first_stop
        else:
            assert decision.reason is expected
            assert decision.stop == (expected is not R.CONTINUE)
            assert decision.committed_tokens == tokens
            if decision.stop:
                first_stop = decision
        assert decision.committed_tokens >= last_committed
        last_committed = decision.committed_tokens
        assert decision.saved_tokens_upper_bound == max(0, p.max_tokens - decision.committed_tokens)
        assert ctl.state.stopped == (first_stop is not None)
        assert ctl.decision is first_stop


@settings(deadline=None, max_examples=examples(100))
@given(
    st.integers(0, 10_000),
    st.integers(0, 10_000),
    st.floats(0.0, 1.0),
    st.integers(0, 1000),
    st.integers(0, 10**7),
)
def test_d4_economics_properties(
    emitted: int, full: int, confidence: float, micros: int, reask: int
) -> None:
    """D4: the identities between the fields, and a break-even on the 1e-6 grid in [0, 1]."""
    e = evaluate_stop_economics(emitted, full, confidence, micros, reask)
    assert e.saved_tokens == max(0, full - emitted)
    assert e.saved_micros == e.saved_tokens * micros
    assert e.net_micros == e.saved_micros - e.expected_loss_micros
    assert e.worth_stopping == (e.net_micros > 0)
    assert 0 <= e.expected_loss_micros <= reask
    assert abs(e.expected_loss_micros - (1 - confidence) * reask) < 1
    assert 0.0 <= e.break_even_confidence <= 1.0
    assert abs(e.break_even_confidence * 1e6 - round(e.break_even_confidence * 1e6)) < 1e-6


def test_d1_sent_keys_names_each_field_as_the_client_spelled_it() -> None:
    """D1: an error names a policy field with the key the client sent (camelCase or
    snake_case); a field not sent, a non-mapping, a non-string or unknown key keep the
    snake_case name."""
    snake = ["min_tokens", "max_tokens", "deadline_ms", "confidence_threshold",
             "no_retry_after_first_frame", "require_closure"]
    assert early_stop.sent_keys(None) == {k: k for k in snake}
    assert early_stop.sent_keys(["minTokens"]) == {k: k for k in snake}
    got = early_stop.sent_keys({"minTokens": 5, "max_tokens": 3, "deadlineMs": 1, 7: 0,
                                "bogus": 1, "requireClosure": True})
    assert got == {"min_tokens": "minTokens", "max_tokens": "max_tokens",
                   "deadline_ms": "deadlineMs", "confidence_threshold": "confidence_threshold",
                   "no_retry_after_first_frame": "no_retry_after_first_frame",
                   "require_closure": "requireClosure"}
