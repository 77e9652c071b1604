"""The early-stop controller at its exact bounds (SPEC D1, D2, D3): what a mutation run of
``coda/early_stop.py`` (``scripts/mutation.sh early_stop``, 186/202) found untested beside
tests/test_early_stop.py — each comparison on its boundary, the starting state, a heartbeat
before any output, and each argument check."""

from __future__ import annotations

import pytest

from coda.early_stop import (
    EarlyStopController,
    EarlyStopPolicy,
    EarlyStopReason,
    approximate_output_tokens,
)
from coda.errors import InvalidRequestError

R = EarlyStopReason


def policy(min_tokens: int = 0, max_tokens: int = 10, deadline_ms: int = 1000,
           threshold: float = 0.9) -> EarlyStopPolicy:
    return EarlyStopPolicy(min_tokens, max_tokens, deadline_ms, threshold, False)


def test_d3_u0080_is_the_first_code_point_counted_as_a_whole_token() -> None:
    """D3: 'above U+007F' starts at U+0080 (a C1 control character), not after U+0080."""
    assert approximate_output_tokens("\x7f") == 1  # NOTE: a quarter, rounded up
    assert approximate_output_tokens("\x7f" * 4) == 1
    assert approximate_output_tokens("\x80" * 4) == 4


def test_d2_reaching_max_tokens_exactly_stops() -> None:
    """D1's hard budget: the delta that brings the count *to* ``max_tokens`` stops."""
    c = EarlyStopController(policy(max_tokens=3, threshold=1.0))
    assert c.on_tokens(2, 0.0, 1).reason is R.CONTINUE
    d = c.on_tokens(1, 0.0, 2)
    assert (d.stop, d.reason, d.committed_tokens, d.saved_tokens_upper_bound) == (
        True, R.MAX_TOKENS, 3, 0)


def test_d2_confidence_equal_to_the_threshold_stops() -> None:
    c = EarlyStopController(policy(min_tokens=1, threshold=0.75))
    assert c.on_tokens(1, 0.74, 1).reason is R.CONTINUE
    assert c.on_tokens(1, 0.75, 2).reason is R.CONFIDENCE


def test_d2_the_controller_starts_at_zero_and_a_heartbeat_moves_only_the_clock() -> None:
    """Before any output the state is all zero; an empty delta (a heartbeat) does not make the
    stream confident, even with ``min_tokens`` 0 (no confidence has been reported yet)."""
    c = EarlyStopController(policy(min_tokens=0, threshold=0.5))
    s = c.state
    assert (s.tokens, s.confidence, s.elapsed_ms, s.first_frame_at_ms) == (0, 0.0, 0, None)
    assert (s.cancelled, s.closed, s.stopped, s.cancel_reason) == (False, False, False, None)
    d = c.on_delta("", 0.99, 0)  # NOTE: elapsed 0 is a valid clock reading
    assert d.reason is R.CONTINUE and c.state.confidence == 0.0
    assert c.state.first_frame_at_ms is None
    assert c.on_delta("x", 0.99, 3).reason is R.CONFIDENCE


def test_d1_arguments_are_checked_with_typed_errors() -> None:
    with pytest.raises(InvalidRequestError) as err:
        EarlyStopController("not a policy")  # type: ignore[arg-type]
    assert err.value.field == "policy"
    c = EarlyStopController(policy())
    with pytest.raises(InvalidRequestError) as err:
        c.cancel(5)  # type: ignore[arg-type]
    assert err.value.field == "reason"
    with pytest.raises(InvalidRequestError) as err:
        c.on_tokens(1, 0.5, 1, text=None)  # type: ignore[arg-type]
    assert err.value.field == "text"
    assert c.decision is None  # NOTE: a refused call decides nothing


@pytest.mark.parametrize("bad", [-1, "3", True, 2.0])
def test_d3_a_token_counter_must_return_an_integer_at_least_zero(bad: object) -> None:
    """A caller's ``count_tokens`` that returns anything but an int >= 0 is a ValueError
    (a bug in the caller, not bad client input), before the count is used."""
    c = EarlyStopController(policy(), count_tokens=lambda _text: bad)  # type: ignore[arg-type,return-value]
    with pytest.raises(ValueError, match="count_tokens returned"):
        c.on_delta("abc", 0.1, 1)
    assert c.state.tokens == 0
