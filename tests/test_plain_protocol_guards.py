"""Issue 22: the Messages, Responses and Ollama adapters skip the tool, field and reasoning
modules at the call site where a request has nothing for them, with the same result as
running them (P1: the same 400s, the same prompt messages, the same plan; T-rules of tool
calling, issue 23's reasoning split).

Each guarded helper is compared, for all generated bodies, with the unguarded call it stands
for: the same value, or the same error with the same words. Only the bodies the guard calls
plain take the skip, so a guard that ignores a field (a tool choice without tools, a
``tool_result`` block, a ``truncation``, a continued response's open calls, a reasoning
budget) returns where the skipped call would have refused, and fails here.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.errors import InvalidRequestError
from coda.reasoning import CLOSE_MARKER, OPEN_MARKER, marker_ids, reasoning_spec
from coda.server import anthropic_routes as an
from coda.server import ollama_routes as ol
from coda.server import responses_routes as rs
from coda.server.anthropic_request import merge_turns, request_path
from coda.server.chat import content_text
from coda.server.fields import effort_budget, reject_unhonoured, responses_effort
from coda.server.ollama_schemas import OllamaChatRequest, OllamaGenerateRequest
from coda.server.protocol_schemas import AnthropicRequest, ResponsesRequest
from coda.server.state import split_reasoning
from coda.server.tool_messages import anthropic_history
from coda.server.tool_results import check_anthropic_results, check_responses_results
from coda.server.tools import anthropic_plan, openai_plan
from tests.conftest import examples


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """A call's value, or its request error's words (what the client would be told)."""
    try:
        return "value", call()
    except InvalidRequestError as exc:
        return "error", (str(exc), exc.field)


def _tokenizer(markers: bool) -> tokenizers.Tokenizer:
    words = ["a", "b", "[UNK]", *([OPEN_MARKER, CLOSE_MARKER] if markers else [])]
    model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]")
    return tokenizers.Tokenizer(model)


TOKENIZERS = (_tokenizer(False), _tokenizer(True))
BUDGETS = st.none() | st.integers(0, 3)


# -- the reasoning split (every protocol: ServerState.reasoning) ------------------------------
@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(TOKENIZERS), st.lists(st.integers(0, 4), max_size=6), BUDGETS)
def test_issue22_the_reasoning_split_is_skipped_only_where_it_is_known(
        tok: tokenizers.Tokenizer, ids: list[int], budget: int | None) -> None:
    """For all prompts and budgets on a model with or without markers: ``split_reasoning``
    answers what ``reasoning_spec`` answers (the split, None, or the 400 naming the budget's
    field): it skips it only with no budget and no markers (a grammar changes nothing: it
    constrains the answer only, issue 23)."""
    markers = marker_ids(tok) is not None
    guarded = outcome(lambda: split_reasoning(tok, markers, ids, budget=budget,
                                              budget_field="f"))
    assert guarded == outcome(lambda: reasoning_spec(tok, ids, budget=budget,
                                                     budget_field="f"))


# -- Messages ---------------------------------------------------------------------------------
BLOCKS = ({"type": "text", "text": "hi"}, {"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {}},
          {"type": "tool_result", "tool_use_id": "t1", "content": "ok"},
          {"type": "tool_result", "tool_use_id": "t9", "content": "ok"},
          {"type": "thinking", "thinking": "hm"}, {"type": "image"})
ANTHROPIC_TOOLS = (None, [], [{"name": "f", "input_schema": {"type": "object"}}])
ANTHROPIC_CHOICES = (None, {"type": "auto"}, {"type": "none"}, {"type": "any"},
                     {"type": "tool", "name": "f"}, {"type": "bogus"})


@st.composite
def anthropic_bodies(draw: st.DrawFn) -> AnthropicRequest:
    messages = []
    for _ in range(draw(st.integers(1, 4))):
        content: Any = (draw(st.sampled_from(["hi", ""])) if draw(st.booleans())
                        else draw(st.lists(st.sampled_from(BLOCKS), max_size=3)))
        messages.append({"role": draw(st.sampled_from(["user", "assistant", "system"])),
                         "content": content})
    return AnthropicRequest(model="m", max_tokens=4, messages=messages,
                            system=draw(st.sampled_from([None, "be brief"])),
                            tools=draw(st.sampled_from(ANTHROPIC_TOOLS)),
                            tool_choice=draw(st.sampled_from(ANTHROPIC_CHOICES)))


def _full_chat_messages(body: AnthropicRequest) -> list[dict[str, Any]]:
    """``chat_messages`` before the guard: every message through the tool modules, and the
    merge of consecutive same-role turns (P1) always run, even where nothing is merged."""
    turns = merge_turns(body.messages)
    try:
        check_anthropic_results(turns)
    except InvalidRequestError as exc:  # NOTE: the merged turns' paths as the request's
        raise InvalidRequestError(request_path(turns, exc.message),
                                  field=request_path(turns, exc.field or "")) from None
    msgs: list[dict[str, Any]] = []
    if body.system:
        msgs.append({"role": "system", "content": content_text(body.system, "system")})
    for i, m in enumerate(body.messages):
        if m.role not in ("user", "assistant"):
            raise an.role_error(i, m.role)  # NOTE: the route's words (a system role says more)
        an._check_text(i, m, last=i == len(body.messages) - 1)  # NOTE: no tool module's
        anthropic_history(m.role, m.content, f"messages.{i}")  # NOTE: its checks, its path
    for t in turns:
        msgs += anthropic_history(t.role, t.content, f"messages.{t.first}")
    return msgs


@settings(max_examples=examples(300), deadline=None)
@given(anthropic_bodies())
def test_issue22_messages_skip_the_tool_modules_only_with_nothing_to_do(
        body: AnthropicRequest) -> None:
    """For all Messages bodies: the tool plan and the chat messages are what the unguarded
    calls give (``anthropic_plan``; every message through ``check_anthropic_results`` and
    ``anthropic_history``), the same 400 included."""
    assert outcome(lambda: an.tool_plan(body)) == outcome(
        lambda: anthropic_plan(body.tools, body.tool_choice))
    assert outcome(lambda: an.chat_messages(body)) == outcome(lambda: _full_chat_messages(body))


# -- Responses --------------------------------------------------------------------------------
FLAT_TOOLS = (None, [], [{"type": "function", "name": "f", "parameters": {"type": "object"}}])
OPENAI_CHOICES = (None, "none", "auto", "required", {"type": "function", "name": "f"},
                  {"type": "function", "function": {"name": "f"}}, "bogus")
ITEMS = ({"role": "user", "content": "hi"},
         {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "c1", "output": "ok"},
         {"type": "function_call_output", "call_id": "c9", "output": "ok"})
HISTORIES = ([], [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
             [{"role": "assistant", "content": "", "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "f", "arguments": "{}"}}]}])
REASONING = (None, {}, {"summary": "auto"}, {"effort": "low"}, {"effort": "none"},
             {"effort": "bogus"}, {"effort": 3})


@st.composite
def responses_bodies(draw: st.DrawFn) -> ResponsesRequest:
    extra: dict[str, Any] = {}
    for name, values in (("tools", FLAT_TOOLS), ("tool_choice", OPENAI_CHOICES),
                         ("truncation", (None, "auto", "disabled")),
                         ("reasoning", REASONING), ("max_reasoning_tokens", (None, 0, 64))):
        if draw(st.integers(0, 2)) == 0:
            extra[name] = draw(st.sampled_from(values))
    given_input: Any = ("hi" if draw(st.booleans())
                        else draw(st.lists(st.sampled_from(ITEMS), max_size=4)))
    return ResponsesRequest(model="m", input=given_input, background=draw(st.booleans()),
                            store=draw(st.booleans()), **extra)


@settings(max_examples=examples(300), deadline=None)
@given(responses_bodies(), st.sampled_from(HISTORIES), st.sampled_from(TOKENIZERS))
def test_issue22_responses_skip_the_tool_and_field_modules_only_with_nothing_to_do(
        body: ResponsesRequest, history: list[dict[str, Any]], tok: tokenizers.Tokenizer
        ) -> None:
    """For all Responses bodies and continued histories: the tool plan, the refusal of
    ``truncation: auto`` / ``background`` without ``store``, the tool-pairing check and the
    reasoning budget are what the unguarded calls give, the same 400 included."""
    assert outcome(lambda: rs.tool_plan(body)) == outcome(
        lambda: openai_plan(body.tools, body.tool_choice, body.parallel_tool_calls, flat=True))
    assert outcome(lambda: rs.check_unhonoured(body)) == outcome(
        lambda: reject_unhonoured(body))
    items = [] if isinstance(body.input, str) else [i.model_dump() for i in body.input]
    assert outcome(lambda: rs.check_results(body, history)) == outcome(
        lambda: check_responses_results(items, history=history))
    server: Any = SimpleNamespace(engine=SimpleNamespace(tokenizer=tok))
    assert outcome(lambda: rs.reasoning_budget(server, body)) == outcome(
        lambda: effort_budget(tok, responses_effort(body.reasoning), body.max_reasoning_tokens))


# -- Ollama -----------------------------------------------------------------------------------
CHAT_TOOLS = (None, [], [{"type": "function", "function": {"name": "f"}}])


@settings(max_examples=examples(200), deadline=None)
@given(st.booleans(), st.sampled_from(CHAT_TOOLS), st.sampled_from(OPENAI_CHOICES))
def test_issue22_ollama_skips_the_tool_module_only_with_nothing_to_do(
        chat: bool, tools: Any, choice: Any) -> None:
    """For all Ollama chat bodies: the tool plan is ``openai_plan``'s (the same 400 for a
    tool choice without tools); a generate body has none."""
    if not chat:
        assert ol.tool_plan(OllamaGenerateRequest(model="m", prompt="hi")) is None
        return
    body = OllamaChatRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                             tools=tools, tool_choice=choice)
    assert outcome(lambda: ol.tool_plan(body)) == outcome(
        lambda: openai_plan(body.tools, body.tool_choice, None))
