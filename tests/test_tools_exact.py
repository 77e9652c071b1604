"""Tool calling meets the exact endings (issue 20 D1, D2; SPEC L4, G1, S1, S2).

Through the official clients against a real server over loopback on the embedded default
model: a budget end under tools is reported as one unless the grammar forced something closed
(issue 20 D1), a stop string never cuts a forced call (issue 20 D2), and required parallel calls never end inside
a call the budget cannot close.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
import tokenizers

from coda.engine.async_engine import DEFAULT_MODEL_DIR
from coda.server import tools as tl
from coda.server.tool_grammar import grammar_for
from tests.tools_support import (
    AN_TOOLS,
    ASK,
    OA_TOOLS,
    RS_TOOLS,
    STORY,
    TEXT_CUT,
    TIME,
    Wire,
    chat_stream,
    serve,
)


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    yield from serve()


@pytest.fixture(scope="module")
def oa(wire: Wire) -> openai.OpenAI:
    return wire.oa


@pytest.fixture(scope="module")
def an(wire: Wire) -> anthropic.Anthropic:
    return wire.an


@pytest.fixture(scope="module")
def model(wire: Wire) -> str:
    return wire.model


_TOK = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))


# -- issue 20 D1: a budget end under tools is a budget end (L4, G1) -------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_issue20_d1_l4_g1_openai_auto_text_cut_by_max_tokens_is_length(
        oa: openai.OpenAI, model: str, stream: bool) -> None:
    """issue 20 D1: tools + auto, a plain-text answer cut by max_tokens is ``length`` /
    ``max_output_tokens`` — the grammar closed nothing (main said ``stop`` /
    ``grammar_forced_close``: auto text accepts at every byte)."""
    kwargs: Any = dict(model=model, messages=STORY, tools=OA_TOOLS, tool_choice="auto",
                       max_tokens=8, extra_body=TEXT_CUT)
    if stream:
        got = chat_stream(oa, **kwargs)
        reason, calls, coda, text = got["reason"], got["calls"], got["coda"], got["content"]
    else:
        choice = oa.chat.completions.create(**kwargs).choices[0]
        reason, calls = choice.finish_reason, choice.message.tool_calls
        coda, text = (choice.model_extra or {})["coda"], choice.message.content
    assert text and not calls
    assert (reason, coda["finish_reason"]) == ("length", "max_output_tokens")
    assert coda["usage"]["selected_tokens"] == 8


@pytest.mark.parametrize("stream", [False, True])
def test_issue20_d1_l4_anthropic_auto_text_cut_by_max_tokens_is_max_tokens(
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
def test_issue20_d1_l4_responses_auto_text_cut_by_max_output_tokens_is_incomplete(
        oa: openai.OpenAI, model: str, stream: bool) -> None:
    """issue 20 D1 (Responses): status ``incomplete`` (``max_output_tokens``), not
    ``completed``."""
    kwargs: Any = dict(model=model, input="Tell me a long story about a cat.", tools=RS_TOOLS,
                       tool_choice="auto", max_output_tokens=16, extra_body=TEXT_CUT)
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


def test_issue20_d1_g1_l4_budget_end_names_only_what_the_grammar_did() -> None:
    """issue 20 D1, G1, L4 (the engine's hook, real grammars): at the budget, free text under
    ``auto`` is not renamed (main: grammar_forced_close), a call complete on its own is
    grammar_complete, and only a forced closing path is grammar_forced_close."""
    from coda.engine.closure import BudgetCloser
    from coda.engine.grammar import compile_grammar
    from coda.finish import FinishReason

    def closer(mode: str, text: str) -> BudgetCloser:
        spec = grammar_for(tl.ToolPlan((tl.Tool("get_time", "", TIME),), mode,  # type: ignore[arg-type]
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


# -- issue 20 D2: a stop string inside the forced tag never cuts the call (S1, S2) ----------
@pytest.mark.parametrize("stop", [">", "_call", "a", "<", "\n"])
def test_issue20_d2_s1_openai_required_call_is_not_cut_by_a_stop_in_its_markup(
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


def test_issue20_d2_s1_openai_required_streamed_and_anthropic_any(
        oa: openai.OpenAI, an: anthropic.Anthropic, model: str) -> None:
    """issue 20 D2 streamed, and Anthropic ``tool_choice: any`` with ``stop_sequences``."""
    got = chat_stream(oa, model=model, messages=ASK, tools=OA_TOOLS[:1], seed=1,
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


def test_l4_s1_required_parallel_never_ends_inside_a_later_call(
        oa: openai.OpenAI, model: str) -> None:
    """L4, S1 (found with issue 20 D1): required + parallel calls under a tight budget: when the
    output is complete and the model opens one more call that cannot close within the
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
