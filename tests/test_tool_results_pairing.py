"""Every tool call is answered before the conversation moves on (the API-gaps issue item 3;
SPEC P1): an OpenAI assistant message with ``tool_calls`` is followed by one ``tool`` message
per call id before the next message of another role, and an Anthropic ``tool_use`` block is
answered by a ``tool_result`` in the next message — else a 400 in the protocol's error shape
naming the message and the unanswered ids, through the official clients over loopback.
"""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.errors import InvalidRequestError
from coda.server.tool_results import check_anthropic_results, check_openai_results

MODEL = "tiny-chat"
USER: Any = {"role": "user", "content": "What time is it in UTC and CET?"}


def _call(cid: str) -> dict[str, Any]:
    return {"id": cid, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


def _calls(*ids: str) -> Any:
    return {"role": "assistant", "content": None, "tool_calls": [_call(i) for i in ids]}


def _answer(cid: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": cid, "content": "12:00"}


def _use(*ids: str) -> dict[str, Any]:
    return {"role": "assistant", "content": [
        {"type": "tool_use", "id": i, "name": "get_time", "input": {}} for i in ids]}


def _results(*ids: str, text: str | None = None) -> dict[str, Any]:
    blocks: list[dict[str, Any]] = [
        {"type": "tool_result", "tool_use_id": i, "content": "12:00"} for i in ids]
    if text is not None:
        blocks.append({"type": "text", "text": text})
    return {"role": "user", "content": blocks}


def test_p1_openai_unanswered_tool_call_is_a_400_naming_the_ids(oa: openai.OpenAI) -> None:
    """P1: a call left unanswered when a user (or assistant) message follows is a 400 in
    OpenAI's shape (``invalid_request_error``) naming the calling message and every missing
    id; answered in any order, or with the conversation ending at the call, it is accepted."""
    both = [USER, _calls("call_a", "call_b"), _answer("call_b"), _answer("call_a")]
    assert oa.chat.completions.create(model=MODEL, messages=both, max_tokens=2).choices
    assert oa.chat.completions.create(model=MODEL, messages=[*both, USER],
                                      max_tokens=2).choices
    trailing = [USER, _calls("call_a")]  # NOTE: nothing follows the call yet
    assert oa.chat.completions.create(model=MODEL, messages=trailing, max_tokens=2).choices
    for messages, missing, nxt in (
            ([USER, _calls("call_a", "call_b"), _answer("call_a"), USER], "call_b", 3),
            ([USER, _calls("call_a"), USER], "call_a", 2),
            ([USER, _calls("call_a", "call_b"), _calls("call_c"), _answer("call_c")],
             "call_a, call_b", 2)):
        with pytest.raises(openai.BadRequestError) as exc:
            oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        body: Any = exc.value.body
        assert exc.value.status_code == 400 and body["type"] == "invalid_request_error"
        assert body["param"] == f"messages.{nxt}.role"
        assert body["message"].startswith(
            f"messages.{nxt}.role: an assistant message with 'tool_calls' (messages.1) must "
            "be followed by tool messages responding to each 'tool_call_id'")
        assert body["message"].endswith(f"did not have response messages: {missing}")


def test_p1_openai_unanswered_call_is_refused_when_streaming(oa: openai.OpenAI) -> None:
    """P1: the check runs before any stream starts: a streamed call gets the same 400."""
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=MODEL, stream=True, max_tokens=2,
                                   messages=[USER, _calls("call_a"), USER])
    assert "call_a" in str(exc.value)


def test_p1_anthropic_unanswered_tool_use_is_a_400_naming_the_ids(
        an: anthropic.Anthropic, server_live: Any) -> None:
    """P1: a ``tool_use`` whose ``tool_result`` the next message lacks is a 400 in Anthropic's
    shape (``{"type": "error", "error": {"type": "invalid_request_error"}}``) naming the next
    message and every missing id — Messages and count_tokens alike; all answered (with text
    beside the results), or the conversation ending at the call, it is accepted."""
    ok = [USER, _use("toolu_1", "toolu_2"), _results("toolu_2", "toolu_1", text="thanks")]
    assert an.messages.create(model=MODEL, max_tokens=2, messages=ok).content is not None
    trailing = [USER, _use("toolu_1")]
    assert an.messages.create(model=MODEL, max_tokens=2, messages=trailing).content is not None
    for messages, missing in (
            ([USER, _use("toolu_1", "toolu_2"), _results("toolu_1")], "toolu_2"),
            ([USER, _use("toolu_1"), USER], "toolu_1"),
            ([USER, _use("toolu_1", "toolu_2"), _results(text="no results")],
             "toolu_1, toolu_2")):
        with pytest.raises(anthropic.BadRequestError) as exc:
            an.messages.create(model=MODEL, max_tokens=2, messages=messages)
        body: Any = exc.value.body
        assert exc.value.status_code == 400 and body["type"] == "error"
        assert body["error"]["type"] == "invalid_request_error"
        message = body["error"]["message"]
        assert message.startswith("messages.2: `tool_use` ids were found without "
                                  "`tool_result` blocks immediately after: " + missing)
        resp = httpx.post(server_live.url + "/v1/messages/count_tokens", timeout=30,
                          json={"model": MODEL, "messages": messages})
        assert resp.status_code == 400 and resp.json()["error"]["message"] == message


# -- for all conversations (the checks alone) ------------------------------------------------
_IDS = st.lists(st.sampled_from([f"call_{c}" for c in "abcdef"]), min_size=1, max_size=4,
                unique=True)


@given(ids=_IDS, data=st.data())
def test_p1_openai_every_call_answered_in_any_order_passes_one_missing_fails(
        ids: list[str], data: st.DataObject) -> None:
    """P1, for all call sets: answered in any order, the conversation passes; drop any one
    answer and it fails naming exactly that id."""
    answers = data.draw(st.permutations(ids))
    check_openai_results([USER, _calls(*ids), *map(_answer, answers), USER])
    dropped = data.draw(st.sampled_from(answers))
    kept = [a for a in answers if a != dropped]
    with pytest.raises(InvalidRequestError) as exc:
        check_openai_results([USER, _calls(*ids), *map(_answer, kept), USER])
    assert str(exc.value).endswith(f"did not have response messages: {dropped}")


@given(ids=_IDS, data=st.data())
def test_p1_anthropic_every_use_answered_in_any_order_passes_one_missing_fails(
        ids: list[str], data: st.DataObject) -> None:
    """P1, for all ``tool_use`` sets: results in any order pass; drop any one and it fails
    naming exactly that id."""
    answers = data.draw(st.permutations(ids))
    check_anthropic_results([USER, _use(*ids), _results(*answers)])
    dropped = data.draw(st.sampled_from(answers))
    with pytest.raises(InvalidRequestError) as exc:
        check_anthropic_results([USER, _use(*ids), _results(*[a for a in answers
                                                               if a != dropped])])
    assert f"immediately after: {dropped}." in str(exc.value)
