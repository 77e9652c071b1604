"""A grammar constrains the answer only, after the reasoning (issue 23; SPEC G1, K2, S1, L4),
through the official clients over loopback and at the engine.

The default model made a reasoning model (tests/reasoning_support.py) with a scripted output:
`` me think`` ``</think>`` then the answer: `` there.`` (free text: tools under ``auto``) or
``1`` (JSON, schema ``integer``), then EOS. Before, a grammar turned the split off and
constrained the output from its first token: on a template that opens ``<think>`` in the
prompt the grammar forced its tokens inside the open block (content garbage, ``length``), and
on one that leaves it to the model the model could not think at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ollama
import openai
import pytest

from coda.engine.grammar import GrammarMatcher
from coda.engine.types import GenerationRequest, GrammarSpec
from coda.reasoning import ReasoningSpec
from coda.sampling import SamplingParams
from tests.reasoning_support import CHAIN, CLOSE_ID, EOS, OPEN_ID, reasoning_server
from tests.wire_support import ScriptedServer

ONE, LBRACKET = 19, 61  # "1", "["
JSON_CHAIN = {**CHAIN, CLOSE_ID: ONE, ONE: EOS}
ARRAY_CHAIN = {**CHAIN, CLOSE_ID: LBRACKET, LBRACKET: ONE, ONE: ONE}  # "[1111…" never closed
MSG: list[Any] = [{"role": "user", "content": "hi"}]
REASONING, ANSWER = " me think", " there."
TOOLS: Any = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
INTEGER: Any = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, CHAIN, inside=True)


@pytest.fixture(scope="module")
def r1json(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, JSON_CHAIN, inside=True)


@pytest.fixture(scope="module")
def r1array(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, ARRAY_CHAIN, inside=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, CHAIN, inside=False)


def _chat(server: ScriptedServer, **kw: Any) -> tuple[str, str | None, str, Any]:
    """(reasoning, content, finish_reason, coda's split record) of a whole chat answer."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=MSG, max_tokens=30, **kw)
    choice = resp.choices[0]
    return ((choice.message.model_extra or {}).get("reasoning", ""), choice.message.content,
            choice.finish_reason, choice.model_extra["coda"].get("reasoning"))


def _chat_stream(server: ScriptedServer, **kw: Any) -> tuple[str, str, str | None]:
    """(reasoning, content, finish_reason) of a streamed chat answer, deltas joined."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    model = client.models.list().data[0].id
    reasoning, content, finish = [], [], None
    for chunk in client.chat.completions.create(model=model, messages=MSG, max_tokens=30,
                                                stream=True, **kw):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning.append((delta.model_extra or {}).get("reasoning") or "")
        content.append(delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), finish


def test_g1_k2_chat_tools_reason_then_answer(r1: ScriptedServer) -> None:
    """G1, K2: with tools (a grammar under ``auto``) on a template that opens the block in the
    prompt, the reasoning is split off as without tools and the grammar meets only the
    answer, whole and streamed."""
    reasoning, content, finish, split = _chat(r1, tools=TOOLS)
    assert (reasoning, content, finish) == (REASONING, ANSWER, "stop")
    assert split["closed"] and not split["forced"]
    assert _chat_stream(r1, tools=TOOLS) == (REASONING, ANSWER, "stop")


def test_g1_k2_chat_json_schema_answer_after_the_reasoning(r1json: ScriptedServer) -> None:
    """G1, K2: ``response_format`` json_schema: the model reasons freely (tokens the schema
    forbids), closes the block itself, and the answer is the schema's: ``1``, ended by the
    grammar's end (EOS), whole and streamed."""
    reasoning, content, finish, _ = _chat(r1json, response_format=INTEGER)
    assert (reasoning, content, finish) == (REASONING, "1", "stop")
    assert _chat_stream(r1json, response_format=INTEGER) == (REASONING, "1", "stop")


def test_k2_l4_budget_forces_the_closer_then_a_grammar_valid_answer(
        r1json: ScriptedServer, r1: ScriptedServer) -> None:
    """K2, L4: a reasoning budget combines with a grammar (it was a 400): after one reasoning
    token the closer is forced, and the answer that follows is the grammar's (JSON schema;
    tools), whole and streamed."""
    budget = {"extra_body": {"max_reasoning_tokens": 1}}
    reasoning, content, finish, split = _chat(r1json, response_format=INTEGER, **budget)
    assert (reasoning, content, finish) == (" me", "1", "stop")
    assert split["forced"] and split["tokens"] == 2  # NOTE: " me" and the forced closer
    assert _chat_stream(r1json, response_format=INTEGER, **budget) == (" me", "1", "stop")
    reasoning, content, finish, split = _chat(r1, tools=TOOLS, **budget)
    assert (reasoning, content, finish) == (" me", ANSWER, "stop") and split["forced"]
    assert _chat_stream(r1, tools=TOOLS, **budget) == (" me", ANSWER, "stop")


def test_l4_answer_closes_within_the_tokens_the_reasoning_left(r1array: ScriptedServer) -> None:
    """L4, G1: the closure within the budget counts the tokens the reasoning left: 3 of
    ``max_tokens`` 10 are reasoning (`` me``, `` think``, the closer), so the array is closed
    at the 10th token (``grammar_forced_close``), never cut open at the budget."""
    schema: Any = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "items": {"type": "integer"}}}}
    client = openai.OpenAI(base_url=r1array.url + "/v1", api_key="k", max_retries=0)
    model = client.models.list().data[0].id
    resp = client.chat.completions.create(model=model, messages=MSG, max_tokens=10,
                                          response_format=schema)
    choice = resp.choices[0]
    assert (choice.message.model_extra or {})["reasoning"] == REASONING
    assert choice.message.content == "[11111]"
    assert choice.model_extra["coda"]["finish_reason"] == "grammar_forced_close"
    assert resp.usage.completion_tokens == 10


def test_k2_model_opens_the_block_under_a_grammar(qwen3: ScriptedServer) -> None:
    """K2, S1: on a template that leaves the block to the model, its first token may be the
    opener under a grammar (the mask allows it there): it reasons, then answers."""
    reasoning, content, finish, split = _chat(qwen3, tools=TOOLS)
    assert (reasoning, content, finish) == (REASONING, ANSWER, "stop")
    assert split["opener"] == "<think>"
    assert _chat_stream(qwen3, tools=TOOLS) == (REASONING, ANSWER, "stop")


def test_k2_responses_text_format_after_the_reasoning(r1json: ScriptedServer) -> None:
    """K2: Responses ``text.format`` json_schema: the reasoning item, then the message with
    the schema's answer."""
    client = openai.OpenAI(base_url=r1json.url + "/v1", api_key="k", max_retries=0)
    model = client.models.list().data[0].id
    fmt: Any = {"format": {"type": "json_schema", "name": "n", "schema": {"type": "integer"}}}
    resp = client.responses.create(model=model, input="hi", text=fmt, max_output_tokens=30)
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    content = resp.output[0].content
    assert content is not None and content[0].text == REASONING
    assert resp.output_text == "1" and resp.status == "completed"


def test_k2_ollama_format_with_think(r1json: ScriptedServer) -> None:
    """K2: Ollama ``format`` (a schema) with ``think``: the thinking, then the JSON answer."""
    client = ollama.Client(host=r1json.url)
    model = client.list().models[0].model
    resp = client.chat(model=model, messages=MSG, format={"type": "integer"}, think=True,
                       options={"num_predict": 30})
    assert (resp.message.thinking, resp.message.content) == (REASONING, "1")


def test_g1_engine_grammar_untouched_by_reasoning_tokens(
        r1json: ScriptedServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """G1, K2: at the engine, the grammar consumes the answer's tokens only: neither the
    reasoning tokens nor the closer advance it (every ``consume`` recorded)."""
    consumed: list[int] = []
    real = GrammarMatcher.consume

    def spy(self: GrammarMatcher, token_id: int) -> bool:
        consumed.append(token_id)
        return real(self, token_id)

    monkeypatch.setattr(GrammarMatcher, "consume", spy)
    engine = r1json.engine
    prompt = tuple(engine.tokenizer.encode("hi\n", add_special_tokens=False).ids)
    req = GenerationRequest(prompt, SamplingParams(temperature=0.0), max_tokens=30,
                            grammar=GrammarSpec(json_schema={"type": "integer"}),
                            reasoning=ReasoningSpec(inside=True, close_ids=(CLOSE_ID,),
                                                    open_ids=(OPEN_ID,)))
    handle = engine.submit(req)
    assert handle.wait(60)
    term = handle.stream.events_after(-1)[-1].terminal
    assert term is not None and term.reasoning is not None
    assert term.reasoning.reasoning_bytes == len(REASONING) and term.reasoning.closer
    assert handle.stream.text() == REASONING + "1"  # NOTE: the stream's text: both parts
    assert consumed == [ONE, EOS]
