"""Tool calls that no argument can break, and verifiable tool streams (issue 20 D3, D5;
SPEC S1, K2, P3).

Through the official clients against a real server over loopback on the embedded default
model: an argument holding the close tag stays one call on every protocol (issue 20 D3), and
``stream_verify`` stamps tool streams contiguously over the engine's bytes and resumes by
offset (issue 20 D5). The parser property checks, for all schema-valid arguments, that the parsed call
carries exactly the generated arguments (oracle: a JSON round trip).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import llguidance as llg
import openai
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.async_engine import DEFAULT_MODEL_DIR
from coda.engine.grammar_tokenizer import ll_tokenizer
from coda.server import tools as tl
from coda.server.tool_grammar import grammar_for
from tests.conftest import LiveServer, examples, sse_events
from tests.tools_support import (
    AN_TOOLS,
    ASK,
    NASTY,
    OA_TOOLS,
    RS_TOOLS,
    STORY,
    TEXT_CUT,
    Wire,
    chat_stream,
    feed_in_pieces,
    serve,
)


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    yield from serve()


@pytest.fixture(scope="module")
def live(wire: Wire) -> LiveServer:
    return wire.live


@pytest.fixture(scope="module")
def oa(wire: Wire) -> openai.OpenAI:
    return wire.oa


@pytest.fixture(scope="module")
def an(wire: Wire) -> anthropic.Anthropic:
    return wire.an


@pytest.fixture(scope="module")
def model(wire: Wire) -> str:
    return wire.model


# -- issue 20 D3: no argument value can break a call (S1, K2) -------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_issue20_d3_k2_openai_argument_with_the_close_tag_stays_one_call(
        oa: openai.OpenAI, model: str, stream: bool) -> None:
    """issue 20 D3: a schema-valid argument string containing ``</tool_call>`` (and the
    open tag, quotes, a backslash, braces): one call whose arguments decode to exactly that
    value (main: the raw call came back as content). K2: every returned byte is in the call."""
    kwargs: Any = dict(model=model, messages=ASK, tools=OA_TOOLS, seed=1, max_tokens=120,
                       parallel_tool_calls=False,
                       tool_choice={"type": "function", "function": {"name": "note"}})
    if stream:
        got = chat_stream(oa, **kwargs)
        assert got["reason"] == "tool_calls" and got["content"] == ""
        calls = [(c["name"], c["arguments"]) for c in got["calls"].values()]
    else:
        choice = oa.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls or []]
        coda = (choice.model_extra or {})["coda"]
        assert coda["tool_calls"]["removed_bytes"] == coda["usage"]["returned_bytes"]
    assert len(calls) == 1 and calls[0][0] == "note"
    assert json.loads(calls[0][1]) == {"text": NASTY}


def test_issue20_d3_anthropic_and_responses_argument_with_the_close_tag(
        oa: openai.OpenAI, an: anthropic.Anthropic, model: str) -> None:
    """issue 20 D3 on Anthropic (``tool_use.input``) and Responses (``function_call``)."""
    msg = an.messages.create(model="default_model", max_tokens=120, messages=ASK,
                             tools=AN_TOOLS, extra_body={"seed": 1},
                             tool_choice={"type": "tool", "name": "note",
                                          "disable_parallel_tool_use": True})
    assert msg.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in msg.content] == [
        ("tool_use", {"text": NASTY})]
    resp = oa.responses.create(model=model, input="note?", tools=RS_TOOLS,
                               tool_choice={"type": "function", "name": "note"},
                               parallel_tool_calls=False, max_output_tokens=120,
                               extra_body={"seed": 1})
    calls = [o for o in resp.output if o.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"text": NASTY}


_TOK = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
_LL = ll_tokenizer(_TOK, frozenset({0, 2}))
_ANY_ARGS = tl.ToolPlan((tl.Tool("f", "", {"type": "object"}),), "auto")
_LARK = grammar_for(_ANY_ARGS)
_PIECES = ["</tool_call>", "<tool_call>", '"', "\\", "{", "}", "[", "]", "\n", "\\n", "é",
           "日本", "😀", "\u2028", "\x00", "\t", "\x7f"]
_STR = st.lists(st.one_of(st.sampled_from(_PIECES), st.text(max_size=4)), max_size=6).map(
    "".join)
_VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), _STR),
                      lambda inner: st.one_of(st.lists(inner, max_size=3),
                                              st.dictionaries(_STR, inner, max_size=3)),
                      max_leaves=6)
_ARGS = st.dictionaries(_STR, _VALUE, max_size=4)


def _accepted(text: str) -> bool:
    assert _LARK is not None and _LARK.lark is not None
    m = llg.LLMatcher(_LL, llg.LLMatcher.grammar_from_lark(_LARK.lark), log_level=0)
    return all(m.consume_token(i) for i in _TOK.encode(text, add_special_tokens=False).ids) \
        and m.is_accepting()


def _written(value: Any, ascii_only: bool) -> str:
    """``value`` as compact JSON: as the grammar writes it (only ``"``, ``\\`` and control
    characters escaped, DEL too), or with every non-ASCII character escaped (what another
    writer may send; the grammar does not produce it, the parser still reads it)."""
    text = json.dumps(value, ensure_ascii=ascii_only, separators=(",", ":"))
    return text.replace("\x7f", "\\u007f")


@settings(max_examples=examples(60))
@given(args=st.lists(_ARGS, min_size=1, max_size=3), ascii_only=st.booleans(),
       before=st.text(max_size=6).filter(lambda t: tl.OPEN_TAG not in t),
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_issue20_d3_k2_s1_for_all_valid_arguments_the_parsed_call_carries_them_exactly(
        args: list[dict[str, Any]], ascii_only: bool, before: str, cuts: list[int]) -> None:
    """issue 20 D3, K2, S1: for all schema-valid arguments (strings holding the tags, quotes,
    backslashes, unicode; any nesting), written as the grammar writes calls — the grammar
    accepts the text — or ASCII-escaped, and cut into deltas anywhere: the parser returns the text before the
    calls and one call per written call whose arguments are the generated bytes and decode to
    the generated value (oracle: json round trip); every call byte is counted as removed."""
    bodies = [_written(a, ascii_only) for a in args]
    calls = [f'{tl.OPEN_TAG}\n{{"name": "f", "arguments": {b}}}\n{tl.CLOSE_TAG}' for b in bodies]
    whole = before + "\n".join(calls)
    assert ascii_only or _accepted(whole)
    p = tl.ToolCallParser()
    items = feed_in_pieces(p, whole, cuts)
    got = [i for i in items if isinstance(i, tl.ToolCall)]
    assert tl.texts(items) == before
    assert [c.arguments for c in got] == bodies
    assert [json.loads(c.arguments) for c in got] == args
    assert [c.index for c in got] == list(range(len(args)))
    assert p.removed_bytes == len(whole.encode()) - len(before.encode())


def test_issue20_d3_an_unclosed_call_is_returned_as_text_whole() -> None:
    """A call cut before its object closes (a close tag inside an argument does not close
    it) comes back as text, byte for byte."""
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>\n'
    assert tl.split(cut) == (cut, [], 0)


# -- issue 20 D5: stream_verify with tools (P3) ----------------------------------------------
def _check_chain(stamps: list[dict[str, Any]], raw: bytes) -> None:
    """Stamps cover the engine output ``raw`` contiguously from 0 to its end, each digest the
    SHA-256 of the bytes through it."""
    assert stamps, "no stamp"
    at = 0
    for s in stamps:
        assert s["offset"] == at and s["length"] > 0
        at += s["length"]
        assert s["digest"] == hashlib.sha256(raw[:at]).hexdigest()
    assert at == len(raw)


def _raw_call(name: str, arguments: str) -> str:
    return f'{tl.OPEN_TAG}\n{{"name": {json.dumps(name)}, "arguments": {arguments}}}\n' \
        f"{tl.CLOSE_TAG}"


def test_issue20_d5_p3_chat_stream_verify_stamps_text_and_calls_with_tools(
        oa: openai.OpenAI, model: str) -> None:
    """issue 20 D5, P3: with tools every text chunk carries its stamp (main: 0 of N), and a
    call's chunk carries the stamp of the call's bytes; the stamps chain over the engine's
    output, call markup included."""
    got = chat_stream(oa, model=model, messages=STORY, tools=OA_TOOLS, tool_choice="auto",
                       max_tokens=12, extra_body={**TEXT_CUT, "stream_verify": True})
    assert got["chunks"] >= 2 and len(got["stamps"]) == got["chunks"]
    _check_chain(got["stamps"], got["content"].encode())
    got = chat_stream(oa, model=model, messages=ASK, tools=OA_TOOLS, seed=1, max_tokens=120,
                       tool_choice="required", parallel_tool_calls=False,
                       extra_body={"stream_verify": True})
    call = got["calls"][0]
    _check_chain(got["stamps"], _raw_call(call["name"], call["arguments"]).encode())


def test_issue20_d5_p3_anthropic_and_responses_stream_verify_with_tools(
        oa: openai.OpenAI, an: anthropic.Anthropic, model: str) -> None:
    """issue 20 D5 on Anthropic (``content_block_delta``) and Responses (delta events)."""
    with an.messages.stream(model="default_model", max_tokens=12, messages=STORY,
                            tools=AN_TOOLS, extra_body={**TEXT_CUT, "stream_verify": True}
                            ) as s:
        deltas = [ev for ev in s if ev.type == "content_block_delta"]
        msg = s.get_final_message()
    stamps = [(ev.model_extra or {})["coda"] for ev in deltas]
    text = "".join(b.text for b in msg.content if b.type == "text")
    assert len(deltas) >= 2
    _check_chain(stamps, text.encode())
    events = list(oa.responses.create(
        model=model, input="note?", tools=RS_TOOLS, stream=True, max_output_tokens=120,
        tool_choice={"type": "function", "name": "note"}, parallel_tool_calls=False,
        extra_body={"seed": 1, "stream_verify": True}))
    stamped = [(e.model_extra or {}).get("coda") for e in events]
    stamps = [s for s in stamped if s]
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(args) == 1
    _check_chain(stamps, _raw_call("note", args[0].arguments).encode())



@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_issue20_d5_p3_resume_by_offset_and_digest_with_tools(live: LiveServer, model: str,
                                                     path: str) -> None:
    """issue 20 D5, P3: with tools, a resume naming a stamp's end (offset, digest) replays
    exactly the events after it, on chat and on Responses (where one delta may render zero or
    several events, so the event number is found by replay, not by counting deltas)."""
    chat = path.endswith("completions")
    body: dict[str, Any] = {"model": model, "stream": True, "stream_verify": True,
                            "tool_choice": "auto", **TEXT_CUT}
    body.update({"messages": STORY, "tools": OA_TOOLS, "max_tokens": 12} if chat else
                {"input": "Tell me a long story about a cat.", "tools": RS_TOOLS,
                 "max_output_tokens": 16})
    with httpx.stream("POST", live.url + path, json=body) as resp:
        events = sse_events(resp.read())
        rid = resp.headers.get("x-request-id")
    stamped = [(k, json.loads(e["data"])["coda"]) for k, e in enumerate(events)
               if e["data"] != "[DONE]" and "digest" in json.loads(e["data"]).get("coda", {})]
    assert len(stamped) >= 3
    k, coda = stamped[1]
    params: dict[str, Any] = {"offset": coda["offset"] + coda["length"],
                              "digest": coda["digest"]}
    if chat:
        url = f"{live.url}/v1/streams/{rid}"
    else:
        rid = json.loads(events[0]["data"])["response"]["id"]
        url, params["stream"] = f"{live.url}/v1/responses/{rid}", "true"
    r = httpx.get(url, params=params)
    assert r.status_code == 200 and sse_events(r.content) == events[k + 1:]
