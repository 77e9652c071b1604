"""Tool calling meets the exact loop (issue 20 D1, D2, D3, D5; SPEC L4, G1, S1, S2, K2, P3).

Through the official clients against a real server over loopback on the embedded default
model: a budget end is reported as one (D1), a stop string never cuts a forced call (D2), no
argument value can break a call (D3), and ``stream_verify`` stamps tool streams (D5). The parser
property checks, for all schema-valid arguments, that the parsed call carries exactly the
generated arguments (oracle: a JSON round trip).
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
from coda.engine.grammar import ll_tokenizer
from coda.server import tools as tl
from tests.conftest import LiveServer, SSEAccumulator, examples

TIME = {"type": "object", "required": ["zone"], "additionalProperties": False,
        "properties": {"zone": {"enum": ["UTC", "CET"]}}}
# NOTE: a schema-valid value holding the close tag, the open tag, quotes, a backslash, braces
NASTY = 'a</tool_call>b "q" \\ <tool_call> {x} é'
NOTE = {"type": "object", "required": ["text"], "additionalProperties": False,
        "properties": {"text": {"enum": [NASTY]}}}
OA_TOOLS: Any = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}},
                 {"type": "function", "function": {"name": "note", "parameters": NOTE}}]
AN_TOOLS: Any = [{"name": "get_time", "input_schema": TIME},
                 {"name": "note", "input_schema": NOTE}]
RS_TOOLS: Any = [{"type": "function", "name": "get_time", "parameters": TIME},
                 {"type": "function", "name": "note", "parameters": NOTE}]
STORY: Any = [{"role": "user", "content": "Tell me a long story about a cat."}]
ASK: Any = [{"role": "user", "content": "What time is it?"}]
# NOTE: ignore_eos: the answer is certainly cut by the budget (D1)
TEXT_CUT: Any = {"seed": 1, "ignore_eos": True}


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


@pytest.fixture(scope="module")
def model(oa: openai.OpenAI) -> str:
    return oa.models.list().data[0].id


def _chat_stream(oa: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    """A streamed chat call, accumulated: content, calls, finish reason, coda, stamps."""
    out: dict[str, Any] = {"content": "", "calls": {}, "reason": None, "coda": None,
                           "stamps": [], "chunks": 0}
    for chunk in oa.chat.completions.create(stream=True, **kwargs):
        extra = chunk.model_extra or {}
        for ch in chunk.choices:
            out["reason"] = ch.finish_reason or out["reason"]
            out["content"] += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                cur = out["calls"].setdefault(d.index, {"name": "", "arguments": ""})
                assert d.function is not None
                cur["name"] += d.function.name or ""
                cur["arguments"] += d.function.arguments or ""
            if ch.delta.content or ch.delta.tool_calls:
                out["chunks"] += 1
        coda = extra.get("coda")
        if coda and "digest" in coda:
            out["stamps"].append(coda)
        if coda and "finish_reason" in coda:
            out["coda"] = coda
    return out


# -- D1: a budget end under tools is a budget end (L4, G1) ----------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_d1_l4_g1_openai_auto_text_cut_by_max_tokens_is_length(
        oa: openai.OpenAI, model: str, stream: bool) -> None:
    """issue 20 D1: tools + auto, a plain-text answer cut by max_tokens is ``length`` /
    ``max_output_tokens`` — the grammar closed nothing (main said ``stop`` /
    ``grammar_forced_close``: auto text accepts at every byte)."""
    kwargs: Any = dict(model=model, messages=STORY, tools=OA_TOOLS, tool_choice="auto",
                       max_tokens=8, extra_body=TEXT_CUT)
    if stream:
        got = _chat_stream(oa, **kwargs)
        reason, calls, coda, text = got["reason"], got["calls"], got["coda"], got["content"]
    else:
        choice = oa.chat.completions.create(**kwargs).choices[0]
        reason, calls = choice.finish_reason, choice.message.tool_calls
        coda, text = (choice.model_extra or {})["coda"], choice.message.content
    assert text and not calls
    assert (reason, coda["finish_reason"]) == ("length", "max_output_tokens")
    assert coda["usage"]["selected_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_d1_l4_anthropic_auto_text_cut_by_max_tokens_is_max_tokens(
        an: anthropic.Anthropic, stream: bool) -> None:
    """issue 20 D1 (Anthropic): stop_reason ``max_tokens``, not ``end_turn``."""
    kwargs: Any = dict(model="default_model", max_tokens=8, messages=STORY, tools=AN_TOOLS,
                       tool_choice={"type": "auto"}, extra_body=TEXT_CUT)
    if stream:
        with an.messages.stream(**kwargs) as s:
            msg = s.get_final_message()
    else:
        msg = an.messages.create(**kwargs)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
def test_d1_l4_responses_auto_text_cut_by_max_output_tokens_is_incomplete(
        oa: openai.OpenAI, model: str, stream: bool) -> None:
    """issue 20 D1 (Responses): status ``incomplete`` (``max_output_tokens``), not
    ``completed``."""
    kwargs: Any = dict(model=model, input="Tell me a long story about a cat.", tools=RS_TOOLS,
                       tool_choice="auto", max_output_tokens=8, extra_body=TEXT_CUT)
    if stream:
        events = list(oa.responses.create(stream=True, **kwargs))
        assert events[-1].type == "response.incomplete"
        resp = events[-1].response  # type: ignore[union-attr]
    else:
        resp = oa.responses.create(**kwargs)
    assert [o.type for o in resp.output] == ["message"]
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"


def test_d1_g1_l4_budget_end_names_only_what_the_grammar_did() -> None:
    """issue 20 D1, G1, L4 (the engine's hook, real grammars): at the budget, free text under
    ``auto`` is not renamed (main: grammar_forced_close), a call complete on its own is
    grammar_complete, and only a forced closing path is grammar_forced_close."""
    from coda.engine.closure import BudgetCloser
    from coda.engine.grammar import compile_grammar
    from coda.finish import FinishReason

    def closer(mode: str, text: str) -> BudgetCloser:
        spec = tl.grammar_for(tl.ToolPlan((tl.Tool("get_time", "", TIME),), mode,  # type: ignore[arg-type]
                                          parallel=False))
        assert spec is not None
        g = compile_grammar(spec, _TOK, _TOK.get_vocab_size(), frozenset({0, 2}))
        c = BudgetCloser(g, 200)
        for i in _TOK.encode(text, add_special_tokens=False).ids:
            assert g.consume(i)
        return c

    assert closer("auto", "Once upon a time, a cat").budget_end() is None
    whole = f'{tl.OPEN_TAG}\n{{"name": "get_time", "arguments": {{"zone":"UTC"}}}}\n{tl.CLOSE_TAG}'
    assert closer("required", whole).budget_end() is FinishReason.GRAMMAR_COMPLETE
    assert closer("auto", "Sure. " + whole).budget_end() is FinishReason.GRAMMAR_COMPLETE
    c = closer("required", whole[:30])
    assert c.budget_end() is None
    path = c.force()
    assert path is not None and path.tokens
    for i in path.tokens:
        assert c.grammar.consume(i)
    assert c.budget_end() is FinishReason.GRAMMAR_FORCED_CLOSE


# -- D2: a stop string inside the forced tag never cuts the call (S1, S2) -------------------
@pytest.mark.parametrize("stop", [">", "_call", "a", "<", "\n"])
def test_d2_s1_openai_required_call_is_not_cut_by_a_stop_in_its_markup(
        oa: openai.OpenAI, model: str, stop: str) -> None:
    """issue 20 D2, S1: tool_choice required; the stop occurs inside ``<tool_call>`` (or its
    JSON): the call still comes back whole (main: no call, content ``"<tool_c"``, ``stop``).
    Stop strings apply to free text; a forced call is markup, never free text."""
    r = oa.chat.completions.create(model=model, messages=ASK, tools=OA_TOOLS[:1], seed=1,
                                   tool_choice="required", parallel_tool_calls=False,
                                   max_tokens=60, stop=[stop])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None and choice.message.tool_calls
    assert json.loads(choice.message.tool_calls[0].function.arguments)["zone"] in ("UTC", "CET")
    assert (choice.model_extra or {})["coda"]["matched_stop"] is None


def test_d2_s1_openai_required_streamed_and_anthropic_any(
        oa: openai.OpenAI, an: anthropic.Anthropic, model: str) -> None:
    """issue 20 D2 streamed, and Anthropic ``tool_choice: any`` with ``stop_sequences``."""
    got = _chat_stream(oa, model=model, messages=ASK, tools=OA_TOOLS[:1], seed=1,
                       tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                       stop=[">"])
    assert got["reason"] == "tool_calls" and got["content"] == ""
    assert [c["name"] for c in got["calls"].values()] == ["get_time"]
    msg = an.messages.create(model="default_model", max_tokens=60, messages=ASK,
                             tools=AN_TOOLS[:1], stop_sequences=[">", "_call"],
                             tool_choice={"type": "any", "disable_parallel_tool_use": True},
                             extra_body={"seed": 1})
    assert msg.stop_reason == "tool_use" and msg.stop_sequence is None
    assert [b.type for b in msg.content] == ["tool_use"]


# -- D3: no argument value can break a call (S1, K2) ----------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_d3_k2_openai_argument_with_the_close_tag_stays_one_call(
        oa: openai.OpenAI, model: str, stream: bool) -> None:
    """issue 20 D3: a schema-valid argument string containing ``</tool_call>`` (and the
    open tag, quotes, a backslash, braces): one call whose arguments decode to exactly that
    value (main: the raw call came back as content). K2: every returned byte is in the call."""
    kwargs: Any = dict(model=model, messages=ASK, tools=OA_TOOLS, seed=1, max_tokens=120,
                       parallel_tool_calls=False,
                       tool_choice={"type": "function", "function": {"name": "note"}})
    if stream:
        got = _chat_stream(oa, **kwargs)
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


def test_d3_anthropic_and_responses_argument_with_the_close_tag(
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
_LARK = tl.grammar_for(_ANY_ARGS)
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
def test_d3_k2_s1_for_all_valid_arguments_the_parsed_call_carries_them_exactly(
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
    items: list[tl.Item] = []
    prev = 0
    for c in sorted(cuts) + [len(whole)]:
        c = min(c, len(whole))
        items += p.feed(whole[prev:c])
        prev = max(prev, c)
    items += p.finish()
    got = [i for i in items if isinstance(i, tl.ToolCall)]
    assert tl.texts(items) == before
    assert [c.arguments for c in got] == bodies
    assert [json.loads(c.arguments) for c in got] == args
    assert [c.index for c in got] == list(range(len(args)))
    assert p.removed_bytes == len(whole.encode()) - len(before.encode())


def test_d3_an_unclosed_call_is_returned_as_text_whole() -> None:
    """A call cut before its object closes (a close tag inside an argument does not close
    it) comes back as text, byte for byte."""
    cut = '<tool_call>\n{"name": "f", "arguments": {"a": "x</tool_call>\n'
    assert tl.split(cut) == (cut, [], 0)


# -- D5: stream_verify with tools (P3) -------------------------------------------------------
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


def test_d5_p3_chat_stream_verify_stamps_text_and_calls_with_tools(
        oa: openai.OpenAI, model: str) -> None:
    """issue 20 D5, P3: with tools every text chunk carries its stamp (main: 0 of N), and a
    call's chunk carries the stamp of the call's bytes; the stamps chain over the engine's
    output, call markup included."""
    got = _chat_stream(oa, model=model, messages=STORY, tools=OA_TOOLS, tool_choice="auto",
                       max_tokens=12, extra_body={**TEXT_CUT, "stream_verify": True})
    assert got["chunks"] >= 2 and len(got["stamps"]) == got["chunks"]
    _check_chain(got["stamps"], got["content"].encode())
    got = _chat_stream(oa, model=model, messages=ASK, tools=OA_TOOLS, seed=1, max_tokens=120,
                       tool_choice="required", parallel_tool_calls=False,
                       extra_body={"stream_verify": True})
    call = got["calls"][0]
    _check_chain(got["stamps"], _raw_call(call["name"], call["arguments"]).encode())


def test_d5_p3_anthropic_and_responses_stream_verify_with_tools(
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


def _sse(raw: bytes) -> list[dict[str, str]]:
    acc, out = SSEAccumulator(), []
    for line in raw.decode().split("\n"):
        ev = acc.feed(line)
        if ev is not None:
            out.append(ev)
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_d5_p3_resume_by_offset_and_digest_with_tools(live: LiveServer, model: str,
                                                     path: str) -> None:
    """issue 20 D5, P3: with tools, a resume naming a stamp's end (offset, digest) replays
    exactly the events after it, on chat and on Responses (where one delta may render zero or
    several events, so the event number is found by replay, not by counting deltas)."""
    chat = path.endswith("completions")
    body: dict[str, Any] = {"model": model, "stream": True, "stream_verify": True,
                            "tool_choice": "auto", **TEXT_CUT}
    body.update({"messages": STORY, "tools": OA_TOOLS, "max_tokens": 12} if chat else
                {"input": "Tell me a long story about a cat.", "tools": RS_TOOLS,
                 "max_output_tokens": 12})
    with httpx.stream("POST", live.url + path, json=body) as resp:
        events = _sse(resp.read())
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
    assert r.status_code == 200 and _sse(r.content) == events[k + 1:]


def test_l4_s1_required_parallel_never_ends_inside_a_later_call(
        oa: openai.OpenAI, model: str) -> None:
    """issue 20 (found with D1), L4, S1: required + parallel calls under a tight budget: when
    the output is complete and the model opens one more call that cannot close within the
    budget, the engine ends the output there (grammar_forced_close) — it never returns a cut
    call as content with ``length`` (main: content ``<tool_call>\\n{"name": "``)."""
    forced = 0
    for seed in range(3):
        choice = oa.chat.completions.create(model=model, messages=ASK, tools=OA_TOOLS[:1],
                                            seed=seed, tool_choice="required",
                                            max_tokens=60).choices[0]
        coda = (choice.model_extra or {})["coda"]
        assert choice.finish_reason == "tool_calls", (choice.message.content, coda)
        assert choice.message.content is None and choice.message.tool_calls
        for tc in choice.message.tool_calls:
            assert json.loads(tc.function.arguments)["zone"] in ("UTC", "CET")
        forced += coda["finish_reason"] == "grammar_forced_close"
    assert forced  # NOTE: the budget is tight enough that the end had to be forced
