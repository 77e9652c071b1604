"""Issue 22: a plain chat skips the tool and field modules at the call site, with the same
result as running them (P1: the same 400s and the same prompt; T-rules of tool calling).

For all chat bodies the guard calls plain, the skipped calls would have raised nothing and
returned what the guard returns: no tool plan, the messages as they are, no legacy shape; and
the chat template gets the same messages whether ``tool_messages.prepare`` runs or not.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from coda.server.chat import _tool_turns, normalise_messages
from coda.server.fields import check_modalities
from coda.server.legacy_functions import has_legacy_history, legacy_history, legacy_tools
from coda.server.openai_routes import _chat_tools, _plain_chat
from coda.server.schemas import ChatCompletionRequest
from coda.server.tool_messages import prepare
from coda.server.tool_results import check_openai_results
from coda.server.tools import openai_plan
from tests.conftest import examples

ROLES = ("system", "developer", "user", "assistant", "tool", "function")
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@st.composite
def messages(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for _ in range(draw(st.integers(1, 4))):
        role = draw(st.sampled_from(ROLES))
        # NOTE: only an assistant (or legacy function) message may leave content out: the
        # others are a 400 at parse (tests/test_bad_nested_types.py)
        m: dict[str, Any] = {"role": role, "content": draw(st.sampled_from(
            ["hi", "", None] if role in ("assistant", "function") else ["hi", ""]))}
        if draw(st.booleans()) and draw(st.booleans()):
            m["tool_calls"] = [CALL]
        if draw(st.integers(0, 5)) == 0:
            m["function_call"] = {"name": "f", "arguments": "{}"}
        if m["role"] == "tool" and draw(st.booleans()):
            m["tool_call_id"] = "c1"
        out.append(m)
    return out


@st.composite
def bodies(draw: st.DrawFn) -> ChatCompletionRequest:
    extra: dict[str, Any] = {}
    if draw(st.integers(0, 3)) == 0:
        extra["tools"] = draw(st.sampled_from([[], [{"type": "function",
                                                     "function": {"name": "f"}}]]))
    if draw(st.integers(0, 3)) == 0:
        extra["tool_choice"] = draw(st.sampled_from(["none", "auto", "required"]))
    if draw(st.integers(0, 4)) == 0:
        extra["modalities"] = draw(st.sampled_from([["text"], ["audio"]]))
    return ChatCompletionRequest(model="m", messages=draw(messages()), **extra)


def _full(body: ChatCompletionRequest) -> tuple[Any, list[Any], bool]:
    """What ``_chat_tools`` did before the guard (every call made)."""
    check_modalities(body.modalities)
    tools, choice, legacy = legacy_tools(body.functions, body.function_call, body.tools,
                                         body.tool_choice)
    msgs: list[Any] = (legacy_history(body.messages) if has_legacy_history(body.messages)
                       else list(body.messages))
    check_openai_results(msgs)
    return openai_plan(tools, choice, False if legacy else body.parallel_tool_calls), msgs, legacy


@settings(max_examples=examples(300), deadline=None)
@given(bodies())
def test_issue22_a_plain_chat_skips_only_calls_with_nothing_to_do(
        body: ChatCompletionRequest) -> None:
    """For all bodies: where the guard says plain, the skipped calls raise nothing and return
    (no plan, the messages unchanged, not legacy), which is what the guarded path returns."""
    if not _plain_chat(body):
        return
    assert _full(body) == (None, list(body.messages), False)
    assert _chat_tools(body) == (None, list(body.messages), False)


@settings(max_examples=examples(300), deadline=None)
@given(messages())
def test_issue22_no_tool_turn_renders_the_same_messages_without_prepare(
        msgs: list[dict[str, Any]]) -> None:
    """For all message lists without tool turns (and no tools): ``prepare`` would hand the
    template the same normalised messages and no ``tools`` (any template source)."""
    if _tool_turns(msgs):
        return
    models = ChatCompletionRequest(model="m", messages=msgs).messages
    try:
        plain = normalise_messages(models)
    except Exception as exc:  # NOTE: a bad role is the same 400 either way
        raw, _ = prepare(models, (), "{{ tools }}")
        try:
            normalise_messages(raw)
        except Exception as exc2:
            assert str(exc2) == str(exc)
            return
        raise AssertionError("only the unprepared messages were refused") from exc
    for source in ("{{ messages }}", "{{ tools }}"):
        raw, tools = prepare(models, (), source)
        assert tools is None
        assert normalise_messages(raw) == plain
