"""Anthropic content blocks' own field types (SPEC P1): a ``tool_result``'s ``is_error`` must
be a boolean, as Anthropic types it; found by the acceptance sweep ("yes" was accepted and
ignored). Checked on :func:`coda.server.tool_messages.anthropic_history`, the one entry every
Messages prompt (and ``count_tokens``) goes through."""

from __future__ import annotations

from typing import Any

import pytest

from coda.errors import InvalidRequestError
from coda.server.tool_messages import anthropic_history


def _result(**extra: Any) -> list[dict[str, Any]]:
    return [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C", **extra}]


@pytest.mark.parametrize("flag", ["yes", 1, 0, None, {"x": 1}])
def test_p1_tool_result_is_error_not_a_boolean_is_a_400_naming_it(flag: Any) -> None:
    """P1: a non-boolean ``is_error`` is a 400 naming ``messages.N.content.J.is_error``."""
    with pytest.raises(InvalidRequestError) as err:
        anthropic_history("user", _result(is_error=flag), "messages.2")
    assert err.value.field == "messages.2.content.0.is_error"
    assert "boolean" in str(err.value)


@pytest.mark.parametrize("extra", [{}, {"is_error": True}, {"is_error": False}])
def test_p1_tool_result_with_a_boolean_or_no_is_error_is_accepted(extra: dict[str, Any]) -> None:
    """P1: absent, ``true`` and ``false`` all render the result as a tool message."""
    out = anthropic_history("user", _result(**extra), "messages.2")
    assert out == [{"role": "tool", "tool_call_id": "toolu_1", "content": "18C"}]
