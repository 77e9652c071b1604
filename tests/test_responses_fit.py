"""Responses ``truncation: "auto"``'s cut (coda.server.responses_fit; SPEC P1, L4): for all
conversations, the fewest oldest items dropped that fit by the plan's rule, never a call
without its output nor an output without its call, system / developer messages kept, and the
uncut prompt (the plan's own 400) when no cut fits."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.plan import fits_context
from coda.errors import ContextLengthExceededError
from coda.server.responses_fit import cut_points, fit, kept


def _render(msgs: list[Any]) -> list[int]:
    """One token per content character, plus one per message (a stand-in template)."""
    return [0] * sum(1 + len(str(m.get("content") or "")) for m in msgs)


def _calls_paired(msgs: list[Any]) -> bool:
    """No tool output without its call before it, no answered call without its output."""
    calls = {c["id"] for m in msgs for c in m.get("tool_calls") or ()}
    outputs = {m["tool_call_id"] for m in msgs if m["role"] == "tool"}
    return outputs <= calls


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["user", "assistant", "system", "developer", "call"]))
        text = "x" * draw(st.integers(0, 30))
        if kind != "call":
            out.append({"role": kind, "content": text})
            continue
        out.append({"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}"}]})
        if draw(st.booleans()):  # NOTE: a user turn between a call and its output
            out.append({"role": "user", "content": text})
        if draw(st.booleans()):  # NOTE: some calls stay unanswered
            out.append({"role": "tool", "tool_call_id": f"c{i}", "content": text})
    return out


@settings(max_examples=300, deadline=None)
@given(conversations(), st.integers(1, 200), st.sampled_from([None, 0, 1, 10]),
       st.booleans())
def test_p1_auto_cut_is_the_fewest_whole_turns_that_fit(
        conv: list[dict[str, Any]], context: int, max_tokens: int | None,
        instructed: bool) -> None:
    """For all conversations and contexts: uncut when it fits ("auto" is "disabled"); else
    the earliest permitted cut that fits (a user message, no call/output pair split, system
    and developer messages kept); else the uncut prompt, for the plan to refuse."""
    head = [{"role": "system", "content": "be brief"}] if instructed else []
    got = fit(_render, head, conv, max_tokens, context)
    whole = _render([*head, *conv])
    if fits_context(len(whole), max_tokens, context):
        assert (got.ids, got.dropped) == (whole, 0)
        return
    fitting = [c for c in cut_points(conv)
               if fits_context(len(_render([*head, *kept(conv, c)[0]])), max_tokens, context)]
    if not fitting:
        assert (got.ids, got.dropped) == (whole, 0)
        return
    msgs, dropped = kept(conv, fitting[0])
    assert (len(got.ids), got.dropped) == (len(_render([*head, *msgs])), dropped)
    assert dropped > 0 and msgs[len(msgs) - len(conv) + fitting[0]]["role"] == "user"
    assert [m for m in conv if m["role"] in ("system", "developer")] == [
        m for m in msgs if m["role"] in ("system", "developer")]
    assert _calls_paired(msgs)


def test_p1_a_call_and_its_output_go_together() -> None:
    """A user turn between a call and its output is no cut point: both go, or neither."""
    conv = [{"role": "user", "content": "a" * 50},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "c1"}]},
            {"role": "user", "content": "b"},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": "c" * 20}]
    assert cut_points(conv) == [4]
    got = fit(_render, [], conv, None, 40)
    assert got.dropped == 4 and len(got.ids) == 21
    # NOTE: an unanswered call may go alone, so the user turn after it is a cut point
    conv[3] = {"role": "assistant", "content": "done"}
    assert cut_points(conv) == [2, 4]
    assert fit(_render, [], conv, None, 40).dropped == 2


def test_p1_no_cut_fits_gives_the_uncut_refusal() -> None:
    """Not even the last turn fits: the uncut prompt (the plan refuses it as "disabled"
    would), or the uncut prompt's own refusal by its bytes."""
    conv = [{"role": "user", "content": "a"}, {"role": "user", "content": "b" * 50}]
    assert fit(_render, [], conv, None, 20).ids == _render(conv)

    def refuse(msgs: list[Any]) -> list[int]:
        if len(msgs) > 1:
            raise ContextLengthExceededError("input: too long", field="input")
        return _render(msgs)

    with pytest.raises(ContextLengthExceededError):
        fit(refuse, [], conv, None, 20)
    assert fit(refuse, [], conv, None, 60).dropped == 1  # NOTE: a refusal is "does not fit"


def test_p1_renders_stay_logarithmic() -> None:
    """About 2 + log2(turns) renders, not one per dropped turn."""
    conv = [{"role": "user", "content": "x" * 10} for _ in range(64)]
    calls = 0

    def counted(msgs: list[Any]) -> list[int]:
        nonlocal calls
        calls += 1
        return _render(msgs)

    got = fit(counted, [], conv, 5, 60)
    assert got.dropped == 59 and calls <= 2 + 7
