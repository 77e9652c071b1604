"""The early-stop inputs' one validation (SPEC D1): every invalid input raises
:class:`coda.errors.InvalidRequestError` whose ``field`` names the culprit.

Shared by the policy, the controller and the stop economics (:mod:`coda.early_stop`) and the
stream-failure decision (:mod:`coda.early_stop_failure`), each of which checks its own
arguments with these.
"""

from __future__ import annotations

from coda.errors import InvalidRequestError


def fail(message: str, field: str) -> InvalidRequestError:
    return InvalidRequestError(f"early_stop: {message}", field=field)


def require_int(value: object, field: str, minimum: int) -> int:
    # NOTE: bool is a subclass of int in Python; True is not a token count, so reject it.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(f"{field} must be an integer >= {minimum}", field)
    return value


def require_confidence(value: object, field: str) -> float:
    # NOTE: the range test is False for NaN and for +-inf, so it also enforces finiteness.
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
        raise fail(f"{field} must be a finite number in [0, 1]", field)
    return float(value)


def require_bool(value: object, field: str) -> bool:
    if not isinstance(value, bool):
        raise fail(f"{field} must be a boolean", field)
    return value
