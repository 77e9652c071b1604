"""Anthropic's ``thinking`` checks, through the official ``anthropic`` client over loopback
(SPEC P1: refused as the real API refuses them, a 400 ``invalid_request_error`` naming the
field). Found by the sweep: ``budget_tokens`` below 1024 and ``budget_tokens >= max_tokens``
were served; a ``thinking`` / ``redacted_thinking`` block in the history without its
``thinking`` / ``signature`` / ``data`` string (or with a number there) was dropped silently."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import examples

MODEL = "tiny-chat"
Q: list[Any] = [{"role": "user", "content": "hi"}]
# NOTE: the tiny model has no reasoning markers: a budget that passes Anthropic's checks
# meets Coda's own 400 ("no reasoning markers") instead, which names the same field
NO_MARKERS = "no reasoning markers"


def _refused(err: anthropic.BadRequestError, field: str) -> str:
    body: Any = err.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
    message: str = body["error"]["message"]
    assert message.startswith(field + ":"), message
    return message


def _client(live: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="k", max_retries=0)


@settings(max_examples=examples(40), deadline=None)
@given(budget=st.integers(0, 3000), max_tokens=st.integers(1, 3000))
def test_p1_budget_tokens_is_at_least_1024_and_below_max_tokens(
        server_live: Any, budget: int, max_tokens: int) -> None:
    """P1, for all budgets and max_tokens: ``budget_tokens < 1024`` or ``>= max_tokens`` is
    a 400 naming ``thinking.budget_tokens``; any other passes Anthropic's checks."""
    with pytest.raises(anthropic.BadRequestError) as info:
        _client(server_live).messages.create(
            model=MODEL, max_tokens=max_tokens, messages=Q,
            thinking={"type": "enabled", "budget_tokens": budget})
    message = _refused(info.value, "thinking.budget_tokens")
    if budget < 1024:
        assert "greater than or equal to 1024" in message, message
    elif budget >= max_tokens:
        assert "max_tokens" in message, message
    else:
        assert NO_MARKERS in message, message


def test_p1_count_tokens_checks_the_floor_not_max_tokens(an: anthropic.Anthropic) -> None:
    """P1: ``count_tokens`` has no ``max_tokens``: the 1024 floor applies, then it counts;
    Coda's ``max_reasoning_tokens`` keeps its own bound (>= 0) for smaller budgets."""
    with pytest.raises(anthropic.BadRequestError) as info:
        an.messages.count_tokens(model=MODEL, messages=Q,
                                 thinking={"type": "enabled", "budget_tokens": 1023})
    _refused(info.value, "thinking.budget_tokens")
    ok = an.messages.count_tokens(model=MODEL, messages=Q,
                                  thinking={"type": "enabled", "budget_tokens": 1024})
    assert ok.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError) as small:
        an.messages.create(model=MODEL, max_tokens=4, messages=Q,
                           thinking={"type": "enabled"},  # type: ignore[typeddict-item]
                           extra_body={"max_reasoning_tokens": 8})
    assert NO_MARKERS in _refused(small.value, "thinking.budget_tokens")


BAD_BLOCKS = [
    ({"type": "thinking", "signature": "s"}, "thinking"),
    ({"type": "thinking", "thinking": "hm"}, "signature"),
    ({"type": "thinking", "thinking": 3, "signature": "s"}, "thinking"),
    ({"type": "thinking", "thinking": "hm", "signature": ["s"]}, "signature"),
    ({"type": "redacted_thinking"}, "data"),
    ({"type": "redacted_thinking", "data": {"x": 1}}, "data"),
]


@pytest.mark.parametrize(("block", "name"), BAD_BLOCKS,
                         ids=[f"{b['type']}-{n}-{i}" for i, (b, n) in enumerate(BAD_BLOCKS)])
def test_p1_malformed_thinking_block_in_history_is_a_400(
        an: anthropic.Anthropic, block: dict[str, Any], name: str) -> None:
    """P1: a malformed thinking block sent back is a 400 naming its path
    (``messages.1.content.0.thinking``), on create and on ``count_tokens``."""
    history: Any = [*Q, {"role": "assistant", "content": [block, {"type": "text", "text": "yo"}]},
                    {"role": "user", "content": "and?"}]
    field = f"messages.1.content.0.{name}"
    with pytest.raises(anthropic.BadRequestError) as info:
        an.messages.create(model=MODEL, max_tokens=2, messages=history)
    message = _refused(info.value, field)
    assert ("Field required" if name not in block else "valid string") in message, message
    with pytest.raises(anthropic.BadRequestError) as counted:
        an.messages.count_tokens(model=MODEL, messages=history)
    _refused(counted.value, field)


def test_p1_well_formed_thinking_blocks_in_history_are_served(an: anthropic.Anthropic) -> None:
    """P1: a thinking block as Coda sends it (an empty ``signature``) and a redacted one are
    taken back: not prompt text, so the prompt is the same as without them."""
    plain: Any = [*Q, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
                  {"role": "user", "content": "and?"}]
    with_blocks: Any = [*Q, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hm", "signature": ""},
        {"type": "redacted_thinking", "data": "opaque"}, {"type": "text", "text": "yo"}]},
        {"role": "user", "content": "and?"}]
    msg = an.messages.create(model=MODEL, max_tokens=2, messages=with_blocks)
    assert msg.type == "message" and msg.usage.output_tokens >= 1
    assert (an.messages.count_tokens(model=MODEL, messages=with_blocks).input_tokens
            == an.messages.count_tokens(model=MODEL, messages=plain).input_tokens)
