"""Tool fields of Chat Completions and Responses answer what OpenAI answers (SPEC P1), through
the official ``openai`` client over loopback on SmolLM2 and Gemma 3 270M (skipped where its
GGUF is absent). Found by sweeping both models with the client:

- Chat ``tool_choice`` (``"auto"``, ``"none"``) or ``parallel_tool_calls`` without ``tools``
  was served, ``tools: []`` too; OpenAI answers a 400 naming the field.
- A named ``tool_choice`` with ``parallel_tool_calls`` left at its default made two or more
  calls of the function; OpenAI's forced function is exactly one call (chat, streamed or
  not, every one of ``n`` choices, and Responses — which still echoes
  ``parallel_tool_calls: true``).
- A Responses ``function_call_output`` whose ``output`` is a list of ``input_text`` parts
  (OpenAI's other form) was a 400 naming ``input`` ("should be a valid string").
- ``tool_choice: {"type": "allowed_tools", ...}`` (chat and Responses) was a 400 ("must be
  none, auto, required or a function"); OpenAI restricts the calls to the listed tools.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.openai_sweep_support import MODELS, RS_TOOLS, TOOLS, U, serve
from tests.openai_sweep_support import bad as _bad
from tests.openai_sweep_support import model_of as _model


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param)


@pytest.mark.parametrize("field,value", [
    ("tool_choice", "none"), ("tool_choice", "auto"), ("tool_choice", "required"),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ("parallel_tool_calls", True), ("parallel_tool_calls", False)])
def test_p1_chat_tool_fields_without_tools_are_a_400(oa: openai.OpenAI, field: str,
                                                     value: Any) -> None:
    """P1: on chat, ``tool_choice`` (any value) and ``parallel_tool_calls`` are only allowed
    with ``tools`` (OpenAI's 400 naming the field), streamed or not; ``tools: []`` is a 400
    naming ``tools``. Responses keeps accepting ``auto`` / ``none`` and
    ``parallel_tool_calls`` without tools (and echoes them), as OpenAI's does."""
    m = _model(oa)
    for stream in (False, True):
        said = _bad(lambda s=stream: oa.chat.completions.create(
            model=m, messages=U, max_tokens=2, stream=s, **{field: value}), field)
        assert "only allowed when 'tools' are specified" in said
    _bad(lambda: oa.chat.completions.create(model=m, messages=U, max_tokens=2, tools=[],
                                            tool_choice="none"), "tools")
    if field == "parallel_tool_calls" or value in ("none", "auto"):
        r = oa.responses.create(model=m, input="hi", max_output_tokens=16, **{field: value})
        assert getattr(r, field) == value


def test_p1_named_tool_choice_makes_exactly_one_call(oa: openai.OpenAI) -> None:
    """P1: a named ``tool_choice`` forces exactly one call of that function, whatever
    ``parallel_tool_calls`` says (default true): on every one of ``n`` chat choices, the same
    streamed and not (one seed), and on Responses, whose object still echoes
    ``parallel_tool_calls`` as sent."""
    m = _model(oa)
    ask: Any = [{"role": "user", "content": "Call f three times with x = 1, 2 and 3."}]
    choice: Any = {"type": "function", "function": {"name": "f"}}
    kw: Any = {"model": m, "messages": ask, "tools": TOOLS, "tool_choice": choice, "n": 3,
               "seed": 7, "max_tokens": 60, "temperature": 1.0}
    r = oa.chat.completions.create(**kw)
    calls = [[(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
             for c in r.choices]
    assert [len(c) for c in calls] == [1, 1, 1] and all(c[0][0] == "f" for c in calls), calls
    assert [c.finish_reason for c in r.choices] == ["tool_calls"] * 3
    streamed: dict[int, list[tuple[str, str]]] = {0: [], 1: [], 2: []}
    for chunk in oa.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            for t in c.delta.tool_calls or []:
                assert t.function is not None
                streamed[c.index].append((str(t.function.name), str(t.function.arguments)))
    assert [streamed[i] for i in range(3)] == calls
    for parallel in (None, True):
        extra: Any = {} if parallel is None else {"parallel_tool_calls": parallel}
        rs = oa.responses.create(model=m, input=ask[0]["content"], tools=RS_TOOLS,
                                 tool_choice={"type": "function", "name": "f"},
                                 max_output_tokens=60, extra_body={"seed": 7}, **extra)
        fcs = [o for o in rs.output if o.type == "function_call"]
        assert [o.name for o in fcs] == ["f"] and rs.parallel_tool_calls is True, rs.output


def test_p1_function_call_output_takes_input_text_parts(oa: openai.OpenAI) -> None:
    """P1: a Responses ``function_call_output`` ``output`` may be a list of content parts, as
    OpenAI's: ``input_text`` parts are joined and answer the call exactly as the same text
    given as a string (same prompt: same ``input_tokens``, same greedy output), listed as sent
    by ``input_items``; an image part is a 400 naming ``input.2.output.1``."""
    m = _model(oa)
    call: Any = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x":1}'}

    def ask(output: Any) -> Any:
        return oa.responses.create(model=m, tools=RS_TOOLS, max_output_tokens=16,
                                   temperature=0, input=[
                                       {"role": "user", "content": "What is f(1)?"}, call,
                                       {"type": "function_call_output", "call_id": "c1",
                                        "output": output}])

    parts: Any = [{"type": "input_text", "text": "4"}, {"type": "input_text", "text": "2"}]
    as_parts, as_text = ask(parts), ask("42")
    assert as_parts.usage and as_text.usage
    assert as_parts.usage.input_tokens == as_text.usage.input_tokens
    assert as_parts.output_text == as_text.output_text
    listed: Any = oa.responses.input_items.list(as_parts.id, order="asc").data
    assert listed[2].type == "function_call_output"
    assert [(p.type, p.text) for p in listed[2].output] == [("input_text", "4"),
                                                            ("input_text", "2")]
    image: Any = [parts[0], {"type": "input_image", "image_url": "http://x/y.png"}]
    _bad(lambda: ask(image), "input.2.output.1")


def test_p1_allowed_tools_choice_limits_the_calls(oa: openai.OpenAI) -> None:
    """P1: OpenAI's ``allowed_tools`` choice: ``required`` makes at least one call, each of a
    listed tool, on every one of ``n`` chat choices (streamed the same) and on Responses
    (``mode``/``tools`` beside ``type``, echoed as sent); ``auto`` never calls an unlisted
    tool. A bad mode, an empty list or an unknown tool is a 400 naming its path."""
    m = _model(oa)
    ask: Any = [{"role": "user", "content": "Call g with x = 2."}]
    only_f: Any = {"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}}
    kw: Any = {"model": m, "messages": ask, "tools": TOOLS, "n": 3, "seed": 1,
               "max_tokens": 60, "tool_choice": only_f}
    r = oa.chat.completions.create(**kw)
    names = [[t.function.name for t in c.message.tool_calls or []] for c in r.choices]
    assert all(n and set(n) == {"f"} for n in names), names
    streamed: dict[int, list[str]] = {0: [], 1: [], 2: []}
    for chunk in oa.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += [str(t.function.name) for t in c.delta.tool_calls or []
                                  if t.function is not None]
    assert [streamed[i] for i in range(3)] == names
    auto: Any = {"type": "allowed_tools", "allowed_tools": {
        "mode": "auto", "tools": [{"type": "function", "function": {"name": "f"}}]}}
    a = oa.chat.completions.create(**{**kw, "tool_choice": auto})
    assert all(t.function.name == "f" for c in a.choices for t in c.message.tool_calls or [])
    choice: Any = {"type": "allowed_tools", "mode": "required",
                   "tools": [{"type": "function", "name": "g"}]}
    rs = oa.responses.create(model=m, input=ask[0]["content"], tools=RS_TOOLS,
                             tool_choice=choice, max_output_tokens=60)
    calls = [o.name for o in rs.output if o.type == "function_call"]
    assert calls and set(calls) == {"g"}, rs.output
    assert rs.tool_choice.type == "allowed_tools"  # type: ignore[union-attr]
    for bad, param in (({"mode": "any", "tools": [{"type": "function", "function": {
            "name": "f"}}]}, "tool_choice.allowed_tools.mode"),
            ({"mode": "auto", "tools": []}, "tool_choice.allowed_tools.tools"),
            ({"mode": "auto", "tools": [{"type": "function", "function": {"name": "h"}}]},
             "tool_choice.allowed_tools.tools.0")):
        _bad(lambda b=bad: oa.chat.completions.create(
            model=m, messages=ask, tools=TOOLS, max_tokens=8,
            tool_choice={"type": "allowed_tools", "allowed_tools": b}), param)
    _bad(lambda: oa.responses.create(
        model=m, input="hi", tools=RS_TOOLS, max_output_tokens=16,
        tool_choice={"type": "allowed_tools", "mode": "required",
                     "tools": [{"type": "function", "name": "h"}]}), "tool_choice.tools.0")
