"""What a sweep of tool calling and structured output through the official clients found
(docs/api.md "Tool calling", "Ollama API"; SPEC P1: bad input is a 400 naming its field, in
the protocol's own shape), on the real SmolLM2 server over loopback.

- Ollama ``format`` with a schema the grammar engine refuses (``"format": "bogus"`` on a
  string) was a 400 that did not name ``format``: the engine's message ("Unknown format:
  bogus") held the word, so the field's name was taken as said already.
- A Responses ``function_call`` input item whose ``arguments`` are not JSON was a 400 naming
  ``input.0.tool_calls.0``, the path of the chat message it is turned into, which no
  Responses request has (and whose index counts merged messages, not input items).
- ``/v1/responses/input_tokens`` counted a request whose ``text.format`` schema the create
  refuses (the grammar is compiled only at submit, which a count never reaches), where the
  docs promise the create's 400s.
- A function tool without ``parameters`` (OpenAI: "omitting parameters defines a function with
  an empty parameter list") was constrained to any object, so a forced call came back with
  keys the model invented (``{"type":[],"description":{"type":[]}}`` on SmolLM2, duplicate
  keys on Gemma 3), which a caller passing them as keyword arguments cannot take.
- A schema request that sent no output limit, whose prompt left fewer tokens of the context
  than the grammar's shortest completion, was a 400 naming ``max_tokens (3)``, a field the
  client never sent; it is the prompt that is too long (``context_length_exceeded``).
- A schema with ``minProperties`` above its required properties and open keys
  (``additionalProperties`` / ``patternProperties``) was answered with JSON that does not
  validate: llguidance does not keep such keys distinct, so ``{"": 0, "": 0}`` met
  ``minProperties: 2`` in the grammar and parsed to one property (every seed, closure or
  not). It is now a 400 naming the field, as a keyword llguidance lacks is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import ollama
import openai
import pytest

from tests.conftest import LiveServer
from tests.openai_sweep_support import GEMMA

# NOTE: a schema llguidance compiles only to refuse it (an unknown string format)
BOGUS: Any = {"type": "object", "properties": {"a": {"type": "string", "format": "bogus"}},
              "required": ["a"]}
HI: Any = [{"role": "user", "content": "Hi"}]


def test_p1_ollama_format_the_grammar_refuses_is_a_400_naming_format(
        smollm_ollama: ollama.Client, smollm_name: str) -> None:
    """P1: chat and generate, streamed or not: the 400 names ``format`` first, as every
    other ``format`` error does, even where the engine's words contain "format"."""
    opts: Any = {"num_predict": 4}
    calls: list[Callable[[], object]] = [
        lambda: smollm_ollama.chat(model=smollm_name, messages=HI, format=BOGUS, options=opts),
        lambda: list(smollm_ollama.chat(model=smollm_name, messages=HI, format=BOGUS,
                                        stream=True, options=opts)),
        lambda: smollm_ollama.generate(model=smollm_name, prompt="Hi", format=BOGUS,
                                       options=opts)]
    for call in calls:
        with pytest.raises(ollama.ResponseError) as exc:
            call()
        assert exc.value.status_code == 400
        assert exc.value.error.startswith("format: invalid grammar: "), exc.value.error
        assert "Unknown format: bogus" in exc.value.error


def test_p1_openai_grammar_errors_keep_their_field(smollm_live: LiveServer,
                                                   smollm_name: str) -> None:
    """P1: the same schema on chat and Responses is named once, by each API's own field."""
    oa = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as chat:
        oa.chat.completions.create(model=smollm_name, messages=HI, max_tokens=4,
                                   response_format={"type": "json_schema", "json_schema": {
                                       "name": "x", "schema": BOGUS}})
    assert chat.value.body["param"] == "response_format"  # type: ignore[index]
    assert chat.value.body["message"].startswith(  # type: ignore[index]
        "response_format: invalid grammar: Unknown format")
    with pytest.raises(openai.BadRequestError) as resp:
        oa.responses.create(model=smollm_name, input="Hi", max_output_tokens=16,
                            text={"format": {"type": "json_schema", "name": "x",
                                             "schema": BOGUS}})
    assert resp.value.body["param"] == "text.format"  # type: ignore[index]
    assert resp.value.body["message"].startswith(  # type: ignore[index]
        "text.format: invalid grammar: Unknown format")


@pytest.mark.parametrize("at", [0, 2])
def test_p1_responses_function_call_with_bad_arguments_names_the_item(
        smollm_live: LiveServer, smollm_name: str, at: int) -> None:
    """P1: the 400 names the input item's own ``arguments`` (``input.N.arguments``), where
    the item is; a valid call and its output in the same place pass."""
    oa = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="k", max_retries=0)
    tools: Any = [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}]
    before: Any = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]

    def items(arguments: str) -> Any:
        return [*before[:at], {"type": "function_call", "call_id": "c1", "name": "f",
                               "arguments": arguments},
                {"type": "function_call_output", "call_id": "c1", "output": "22C"}]

    with pytest.raises(openai.BadRequestError) as exc:
        oa.responses.create(model=smollm_name, input=items("{bad"), tools=tools,
                            max_output_tokens=16)
    body: Any = exc.value.body
    assert body["param"] == f"input.{at}.arguments", body
    assert body["message"] == f"input.{at}.arguments: arguments must be JSON", body
    ok = oa.responses.create(model=smollm_name, input=items('{"city": "Paris"}'), tools=tools,
                             max_output_tokens=16, temperature=0)
    assert ok.status in ("completed", "incomplete")


@pytest.mark.parametrize("schema", [BOGUS, {"type": "object", "properties": {
    "a": {"$ref": "#/$defs/none"}}}])
def test_p1_responses_input_tokens_takes_the_create_s_grammar_400(
        smollm_live: LiveServer, smollm_name: str, schema: Any) -> None:
    """P1: a ``text.format`` the create refuses is no count but the same 400 (its message
    and field); a schema it takes is counted."""
    oa = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="k", max_retries=0)
    fmt: Any = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    with pytest.raises(openai.BadRequestError) as create:
        oa.responses.create(model=smollm_name, input="Hi", max_output_tokens=16, text=fmt)
    with pytest.raises(openai.BadRequestError) as count:
        oa.responses.input_tokens.count(model=smollm_name, input="Hi", text=fmt)
    body: Any = count.value.body
    assert body["param"] == "text.format", body
    assert body["message"] == create.value.body["message"], body  # type: ignore[index]
    fine: Any = {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    assert oa.responses.input_tokens.count(model=smollm_name, input="Hi",
                                           text=fine).input_tokens > 0


@pytest.fixture(scope="module")
def gemma_oa() -> Any:
    from tests.openai_sweep_support import serve

    yield from serve("gemma3", default_max_tokens=40)


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_s1_a_tool_without_parameters_is_called_with_no_arguments(
        request: pytest.FixtureRequest, which: str) -> None:
    """S1: chat (streamed and not) and Responses, several seeds: every call of a function
    tool sent without ``parameters`` has ``arguments`` ``{}``."""
    if which == "gemma3" and not GEMMA.exists():
        pytest.skip(f"{GEMMA} is not here")
    if which == "smollm2":
        live: LiveServer = request.getfixturevalue("smollm_live")
        oa = openai.OpenAI(base_url=live.url + "/v1", api_key="k", max_retries=0)
    else:
        oa = request.getfixturevalue("gemma_oa")
    model = oa.models.list().data[0].id
    ask: Any = [{"role": "user", "content": "Ping the server, please."}]
    chat_tools: Any = [{"type": "function", "function": {"name": "ping"}}]
    seen: list[str] = []
    for seed in range(3):
        kw: Any = {"model": model, "messages": ask, "tools": chat_tools, "max_tokens": 40,
                   "tool_choice": "required", "temperature": 1.0, "seed": seed}
        whole = oa.chat.completions.create(**kw)
        seen += [c.function.arguments for c in whole.choices[0].message.tool_calls or []]
        for chunk in oa.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                seen += [d.function.arguments or "" for d in ch.delta.tool_calls or []
                         if d.function is not None]
    flat: Any = [{"type": "function", "name": "ping"}]  # NOTE: no parameters, no strict
    resp = oa.responses.create(model=model, input="Ping the server, please.", temperature=1.0,
                               tools=flat, tool_choice="required", max_output_tokens=40)
    seen += [o.arguments for o in resp.output if o.type == "function_call"]
    assert len(seen) >= 7 and set(seen) == {"{}"}, seen


def test_g1_no_limit_sent_and_no_room_for_the_grammar_names_the_prompt(
        smollm_live: LiveServer, smollm_name: str, smollm_engine: Any) -> None:
    """G1/L4: the budget is the room the prompt leaves (legacy completions' omitted
    ``max_tokens`` where 16 do not fit; Ollama's unset ``num_predict``): a grammar that cannot
    close in it is the prompt's 400 (``context_length_exceeded``), never one naming a
    ``max_tokens`` nobody sent; with ``max_tokens`` sent, that field is named as before."""
    oa = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="k", max_retries=0)
    schema: Any = {"type": "object", "properties": {"name": {"type": "string"}},
                   "required": ["name"], "additionalProperties": False}
    fmt: Any = {"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": schema}}}
    prompt = [1000] * (smollm_engine.context_length - 3)
    with pytest.raises(openai.BadRequestError) as omitted:
        oa.completions.create(model=smollm_name, prompt=prompt, extra_body=fmt)
    body: Any = omitted.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "prompt", body
    assert "max_tokens" not in body["message"] and "3 left" in body["message"], body
    with pytest.raises(openai.BadRequestError) as sent:
        oa.completions.create(model=smollm_name, prompt=prompt, max_tokens=3, extra_body=fmt)
    body = sent.value.body
    assert body["param"] == "max_tokens" and body["message"].startswith("max_tokens (3)"), body
    with pytest.raises(ollama.ResponseError) as unset:
        ollama.Client(host=smollm_live.url).generate(
            model=smollm_name, prompt="x", raw=True, context=prompt[1:], format=schema)
    assert unset.value.status_code == 400 and "num_predict" not in unset.value.error
    assert unset.value.error.startswith("the prompt has"), unset.value.error


OPEN_KEYS: Any = {"type": "object", "minProperties": 2, "additionalProperties": {"type": "integer"}}


def test_g1_min_properties_the_grammar_cannot_keep_is_a_400(
        smollm_live: LiveServer, smollm_name: str, smollm_ollama: ollama.Client) -> None:
    """G1/P1: refused on every door that takes a schema (chat ``response_format``, a tool's
    ``parameters``, Ollama ``format``), nested too; a ``minProperties`` the required
    properties meet is served, and its answers validate."""
    oa = openai.OpenAI(base_url=smollm_live.url + "/v1", api_key="k", max_retries=0)
    nested: Any = {"type": "object", "properties": {"o": OPEN_KEYS}, "required": ["o"]}
    for schema in (OPEN_KEYS, nested):
        with pytest.raises(openai.BadRequestError) as rf:
            oa.chat.completions.create(model=smollm_name, messages=HI, max_tokens=40,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": schema}})
        body: Any = rf.value.body
        assert body["param"] == "response_format" and "minProperties (2)" in body["message"]
    with pytest.raises(openai.BadRequestError) as tool:
        oa.chat.completions.create(model=smollm_name, messages=HI, max_tokens=40,
                                   tools=[{"type": "function", "function": {
                                       "name": "f", "parameters": OPEN_KEYS}}])
    body = tool.value.body
    assert body["param"] == "tools.0" and "minProperties (2)" in body["message"], body
    with pytest.raises(ollama.ResponseError) as fmt:
        smollm_ollama.chat(model=smollm_name, messages=HI, format=OPEN_KEYS,
                           options={"num_predict": 40})
    assert fmt.value.error.startswith("format: invalid grammar: minProperties (2)")
    met: Any = {"type": "object", "minProperties": 1, "required": ["a"],
                "properties": {"a": {"type": "integer"}}, "additionalProperties": True}
    for seed in range(3):
        r = oa.chat.completions.create(model=smollm_name, messages=HI, max_tokens=40, seed=seed,
                                       temperature=1.0, response_format={
                                           "type": "json_schema", "json_schema": {
                                               "name": "x", "schema": met}})
        assert isinstance(json.loads(r.choices[0].message.content or "")["a"], int)
