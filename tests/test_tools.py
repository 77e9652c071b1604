"""Tool calling through the official clients on the embedded default model (issue 13 item 1;
SPEC S1, K2, L4, P3).

The default model was never trained for tools, so the round trips force the call
(``tool_choice`` required / named / Anthropic ``any`` / ``tool``): the arguments are then
constrained by the tool's JSON schema and must validate. ``auto`` is checked at the parser and
grammar level (the opening tag never leaks, stop strings never cut a call).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from coda.models.tokenizer_bundle import DEFAULT_CHAT_TEMPLATE
from coda.server import tools as tl
from coda.server.tool_grammar import grammar_for
from tests.conftest import LiveServer
from tests.tools_support import feed_in_pieces

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "maxLength": 12},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "required": ["zone"], "additionalProperties": False,
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
OA_TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
AN_TOOLS: Any = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
                 {"name": "get_time", "input_schema": TIME}]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
ASK_JSON: Any = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


@pytest.fixture(scope="module")
def live() -> Iterator[LiveServer]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    engine = AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=8))
    engine.start()
    server = LiveServer(create_app(engine, manage_engine=False)).start()
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def oa(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def an(live: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="x", max_retries=0)


def _valid(name: str, arguments: str | dict[str, Any]) -> None:
    args = json.loads(arguments) if isinstance(arguments, str) else arguments
    jsonschema.validate(args, SCHEMAS[name])


# -- OpenAI Chat Completions ---------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_s1_l4_openai_forced_tool_round_trip(oa: openai.OpenAI, stream: bool) -> None:
    """S1/L4: a forced call validates, finish_reason is tool_calls; its result goes back in the
    history (assistant tool_calls + tool message) and the model answers in text."""
    model = oa.models.list().data[0].id
    kwargs: Any = dict(model=model, messages=ASK, tools=OA_TOOLS, seed=3, max_tokens=120,
                       parallel_tool_calls=False,
                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls: dict[int, dict[str, Any]] = {}
        reason = None
        contents = []
        for chunk in oa.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                reason = ch.finish_reason or reason
                if ch.delta.content:
                    contents.append(ch.delta.content)
                for d in ch.delta.tool_calls or []:
                    cur = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                    cur["id"] = d.id or cur["id"]
                    if d.function is not None:
                        cur["name"] += d.function.name or ""
                        cur["arguments"] += d.function.arguments or ""
        assert reason == "tool_calls" and "".join(contents) == ""
        assert list(calls) == [0]
        call = calls[0]
    else:
        r = oa.chat.completions.create(**kwargs)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None and choice.message.tool_calls
        assert len(choice.message.tool_calls) == 1
        tc = choice.message.tool_calls[0]
        call = {"id": tc.id, "name": tc.function.name, "arguments": tc.function.arguments}
        extra = choice.model_extra or {}
        assert extra["coda"]["finish_reason"] == "grammar_complete"
        # K2: the call's bytes are moved out of the text, every returned byte accounted for
        assert extra["coda"]["tool_calls"]["removed_bytes"] == \
            extra["coda"]["usage"]["returned_bytes"]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    _valid("get_weather", call["arguments"])
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": call["name"], "arguments": call["arguments"]}}]},
               {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    answer = oa.chat.completions.create(model=model, messages=history, tools=OA_TOOLS,
                                        tool_choice="none", seed=1, max_tokens=12)
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].message.content


def test_s1_openai_required_parallel_calls_all_validate(oa: openai.OpenAI) -> None:
    """required + parallel: one or more calls, each naming a declared tool, each valid."""
    model = oa.models.list().data[0].id
    for seed in range(3):
        r = oa.chat.completions.create(model=model, messages=ASK, tools=OA_TOOLS, seed=seed,
                                       tool_choice="required", max_tokens=200)
        choice = r.choices[0]
        if choice.finish_reason != "tool_calls":
            continue  # NOTE: the budget ran out inside a later parallel call
        assert choice.message.tool_calls
        for i, tc in enumerate(choice.message.tool_calls):
            assert tc.id.endswith(f"_{i}")
            _valid(tc.function.name, tc.function.arguments)


def test_l4_tool_errors_are_400(oa: openai.OpenAI) -> None:
    model = oa.models.list().data[0].id
    bad: list[dict[str, Any]] = [
        {"tools": OA_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        {"tools": [{"type": "retrieval"}]},
        {"tool_choice": "required"},
        {"tools": OA_TOOLS, "tool_choice": "required",
         "response_format": {"type": "json_object"}},
    ]
    for extra in bad:
        # NOTE: "JSON" in the question: json_object needs the word (OpenAI's rule), so the
        # refusal is the tools + response_format one
        with pytest.raises(openai.BadRequestError):
            oa.chat.completions.create(model=model, messages=ASK_JSON, max_tokens=5,
                                       **extra)


# -- Anthropic Messages --------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_s1_l4_anthropic_forced_tool_round_trip(an: anthropic.Anthropic, stream: bool) -> None:
    """tool_choice any → a tool_use block (input valid), stop_reason tool_use; the tool_result
    goes back and the model answers in text."""
    kwargs: Any = dict(model="default_model", max_tokens=120, messages=ASK, tools=AN_TOOLS,
                       tool_choice={"type": "tool", "name": "get_weather",
                                    "disable_parallel_tool_use": True},
                       extra_body={"seed": 5})
    if stream:
        with an.messages.stream(**kwargs) as s:
            kinds = [ev.type for ev in s]
            msg = s.get_final_message()
        assert "input_json" in kinds or "content_block_delta" in kinds
    else:
        msg = an.messages.create(**kwargs)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather"
    assert all(b.type == "tool_use" for b in msg.content)
    _valid("get_weather", uses[0].input)  # type: ignore[arg-type]
    history: Any = [*ASK, {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result",
                                                  "tool_use_id": uses[0].id,
                                                  "content": "sunny, 21 C"}]}]
    answer = an.messages.create(model="default_model", max_tokens=12, messages=history,
                                tools=AN_TOOLS, extra_body={"seed": 1})
    assert answer.content and answer.content[0].type in ("text", "tool_use")


# -- Responses -----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_s1_responses_forced_function_call(oa: openai.OpenAI, stream: bool) -> None:
    """S1, K2: a forced call's response is the call alone: ``output[0]`` is the function call
    (no empty message item beside it, as OpenAI's), and the stream opens exactly the final
    response's items, at the same output indices, each once."""
    model = oa.models.list().data[0].id
    tools: Any = [{"type": "function", "name": "get_time", "parameters": TIME, "strict": True}]
    kwargs: Any = dict(model=model, input="time?", tools=tools, tool_choice="required",
                       parallel_tool_calls=False, max_output_tokens=60,
                       extra_body={"seed": 2})
    if stream:
        events = list(oa.responses.create(stream=True, **kwargs))
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.done" in kinds
        resp = events[-1].response  # type: ignore[union-attr]
        added = [(e.output_index, e.item.type) for e in events  # type: ignore[union-attr]
                 if e.type == "response.output_item.added"]
        done = [(e.output_index, e.item.type) for e in events  # type: ignore[union-attr]
                if e.type == "response.output_item.done"]
        assert added == done == list(enumerate(o.type for o in resp.output)), (added, done)
    else:
        resp = oa.responses.create(**kwargs)
    assert [o.type for o in resp.output] == ["function_call"], resp.output
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_time"
    _valid("get_time", calls[0].arguments)
    follow = oa.responses.create(model=model, max_output_tokens=16, tools=tools, input=[
        {"role": "user", "content": "time?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_time",
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}])
    assert follow.status in ("completed", "incomplete")


# -- the parser and grammar (auto) ---------------------------------------------------------
def test_k2_parser_holds_back_the_tag_and_removes_call_bytes() -> None:
    p = tl.ToolCallParser()
    out = p.feed("Hi <tool")
    assert tl.texts(out) == "Hi "  # NOTE: "<tool" could open a call: held back
    out += p.feed('_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    out += p.finish()
    assert tl.texts(out) == "Hi "
    calls = [i for i in out if isinstance(i, tl.ToolCall)]
    assert calls == [tl.ToolCall(0, "f", '{"a": 1}')]
    assert p.removed_bytes == len('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n'
                                  '</tool_call>')


_SAFE = st.text(alphabet=st.sampled_from(list("ab<>_/tol \n{}\"")), max_size=30)


@given(_SAFE, st.lists(st.integers(0, 40), max_size=4))
def test_k2_parser_is_chunking_invariant(text: str, cuts: list[int]) -> None:
    """For all texts and all ways to cut them into deltas, the incremental parser returns what
    the one-shot split returns (text and calls) — the tag never leaks differently by chunking."""
    whole = text + '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>'
    ref_text, ref_calls, ref_removed = tl.split(whole)
    p = tl.ToolCallParser()
    items = feed_in_pieces(p, whole, cuts)
    assert tl.texts(items) == ref_text
    assert [i for i in items if isinstance(i, tl.ToolCall)] == ref_calls
    assert p.removed_bytes == ref_removed
    assert "".join(i if isinstance(i, str) else "" for i in items) + "" == ref_text


def test_s1_auto_grammar_constrains_only_after_the_tag() -> None:
    """auto: text is free but cannot contain a stray opening tag; once the tag is written the
    arguments must follow the schema."""
    import llguidance as llg
    import tokenizers

    from coda.engine.async_engine import DEFAULT_MODEL_DIR
    from coda.engine.grammar_tokenizer import ll_tokenizer

    tok = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    plan = tl.ToolPlan((tl.Tool("get_time", "", TIME),), "auto")
    spec = grammar_for(plan)
    assert spec is not None and spec.lark is not None

    def accepts(text: str) -> bool:
        m = llg.LLMatcher(ll_tokenizer(tok, frozenset({0, 2})),
                          llg.LLMatcher.grammar_from_lark(spec.lark), log_level=0)
        return all(m.consume_token(i) for i in tok.encode(text).ids) and m.is_accepting()

    assert accepts("Just text, <b>no call</b>.")
    assert accepts('Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone":"UTC"}}\n'
                   "</tool_call>")
    assert not accepts("<tool_call> oops")
    assert not accepts('<tool_call>\n{"name": "get_time", "arguments": {"zone":"PST"}}\n'
                       "</tool_call>")


def test_s1_stop_string_never_cuts_inside_a_call(oa: openai.OpenAI) -> None:
    """S1 (issue 13): stop strings apply to text before a call opens; a stop that occurs inside
    the constrained arguments does not end the output."""
    model = oa.models.list().data[0].id
    r = oa.chat.completions.create(
        model=model, messages=ASK, tools=OA_TOOLS, seed=3, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False, stop=['"zone"', "UTC", "CET", "}"])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    _valid("get_time", choice.message.tool_calls[0].function.arguments)


# -- the prompt: tools and tool history ------------------------------------------------------
_TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.zone }}{% endfor %}"
    "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}\n{% endfor %}")


class _Engine:
    """What render_chat reads off an engine: its chat bundle (ChatML when no template)."""

    def __init__(self, template: str | None) -> None:
        self.chat = SimpleNamespace(chat_template=template or DEFAULT_CHAT_TEMPLATE,
                                    bos_token="", eos_token="")


def test_s1_template_with_tools_receives_them_as_transformers_passes_them() -> None:
    """A template that mentions tools gets tools=[{"type": "function", "function": ...}],
    assistant tool_calls with arguments as an object, and tool messages with tool_call_id."""
    from coda.server.chat import render_chat

    plan = tl.openai_plan(OA_TOOLS, "auto", None)
    assert plan is not None
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    text = render_chat(_Engine(_TOOL_TEMPLATE), history, add_generation_prompt=False,
                       tools=plan.tools)
    # NOTE: trim_blocks (as transformers renders) eats the newline after each block tag
    assert text == ("TOOLS:get_weather;get_time;<user>What is the weather in Paris?"
                    "<assistant>CALL get_time UTC<tool>12:00 (for c1)")


def test_s1_default_template_gets_tool_prompt_and_history_in_call_syntax() -> None:
    """Without tool support in the template (the default ChatML): a system message lists the
    tools, a past call is written in the call syntax, a result is a <tool_response> message."""
    from coda.server.chat import render_chat

    plan = tl.openai_plan(OA_TOOLS, "required", None)
    assert plan is not None
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    text = render_chat(_Engine(None), history, tools=plan.tools)
    assert text.startswith("<|im_start|>system\n# Tools")
    assert '"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": '
            '{"zone": "UTC"}}\n</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n12:00\n</tool_response><|im_end|>" in text
    assert tl.split(text.split("<|im_start|>assistant\n")[1])[1] == [
        tl.ToolCall(0, "get_time", '{"zone": "UTC"}')]


def test_k2_responses_items_follow_the_output_order() -> None:
    """K2, S1: a Responses output's items in the model's order: the message item (its text
    outside calls) sits before the calls the model wrote after its first text, and there is
    none when the output is calls alone; an empty output is one empty message."""
    from coda.server.responses_object import layout as _layout

    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    assert _layout("") == ("", [], 0)
    assert _layout("Hi") == ("Hi", [], 0)
    text, calls, at = _layout(call + call)
    assert (text, len(calls), at) == ("", 2, None)
    assert _layout("Hi " + call)[2] == 0
    text, calls, at = _layout(call + "then" + call)
    assert (text, [c.index for c in calls], at) == ("then", [0, 1], 1)
