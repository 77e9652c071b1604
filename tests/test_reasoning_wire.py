"""Reasoning output through the official clients over loopback (issue 23 item 3; SPEC K2, S1,
P1, P3), on the default model made a reasoning model (tests/reasoning_support.py) with a
scripted output: `` me think`` ``</think>`` `` there.`` then EOS.

``r1``: the template opens ``<think>\\n`` in the generation prompt (DeepSeek-R1); ``qwen3``:
the model writes ``<think>`` itself. The engine, detokenizer, splitter, stops, routes and SSE
are the product.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from tests.reasoning_support import CHAIN, reasoning_model_dir, reasoning_server
from tests.wire_support import ScriptedServer

MSG: list[Any] = [{"role": "user", "content": "hi"}]
REASONING, ANSWER = " me think", " there."
FULL = REASONING + "</think>" + ANSWER


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, CHAIN, inside=True)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ScriptedServer]:
    yield from reasoning_server(tmp_path_factory, CHAIN, inside=False)


def oai(server: ScriptedServer) -> tuple[openai.OpenAI, str]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0)
    return client, client.models.list().data[0].id


def _chat(server: ScriptedServer, **kw: Any) -> Any:
    client, model = oai(server)
    return client.chat.completions.create(model=model, messages=MSG, **kw)


def test_k2_chat_splits_reasoning_from_the_answer(r1: ScriptedServer) -> None:
    """Chat: ``message.reasoning`` and ``message.reasoning_content`` carry the reasoning, the
    content only the answer; the split record reassembles the decode (K2)."""
    resp = _chat(r1)
    msg = resp.choices[0].message
    extra = msg.model_extra or {}
    assert msg.content == ANSWER
    assert extra["reasoning"] == extra["reasoning_content"] == REASONING
    split = resp.choices[0].model_extra["coda"]["reasoning"]
    assert split == {"opener": "", "bytes": len(REASONING), "closer": "</think>",
                     "closed": True, "forced": False, "tokens": 3}
    assert split["opener"] + extra["reasoning"] + split["closer"] + msg.content == FULL
    assert resp.usage.completion_tokens_details.reasoning_tokens == 3


def test_k2_chat_stream_sends_reasoning_deltas_first(r1: ScriptedServer) -> None:
    client, model = oai(r1)
    reasoning, content, order = [], [], []
    for chunk in client.chat.completions.create(model=model, messages=MSG, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning"):
            assert extra["reasoning_content"] == extra["reasoning"]
            reasoning.append(extra["reasoning"])
            order.append("r")
        if delta.content:
            content.append(delta.content)
            order.append("c")
    assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
    assert order == sorted(order, reverse=True)  # every reasoning delta before the answer


def test_s1_stops_apply_to_the_answer_only(r1: ScriptedServer) -> None:
    """A stop string inside the reasoning never cuts it; the same stop in the answer does."""
    resp = _chat(r1, stop=["think", "ere"])
    extra = resp.choices[0].message.model_extra or {}
    assert extra["reasoning"] == REASONING
    assert resp.choices[0].message.content == " th"
    assert resp.choices[0].model_extra["coda"]["matched_stop"] == "ere"


def test_reasoning_budget_forces_the_closer(r1: ScriptedServer) -> None:
    """``max_reasoning_tokens``: after one reasoning token the engine forces ``</think>`` and
    the answer continues; the record says forced."""
    resp = _chat(r1, extra_body={"max_reasoning_tokens": 1})
    extra = resp.choices[0].message.model_extra or {}
    assert extra["reasoning"] == " me"
    assert resp.choices[0].message.content == ANSWER
    split = resp.choices[0].model_extra["coda"]["reasoning"]
    assert split["forced"] is True and split["tokens"] == 2
    assert resp.choices[0].finish_reason == "stop"


def test_include_reasoning_false_drops_it(r1: ScriptedServer) -> None:
    resp = _chat(r1, extra_body={"include_reasoning": False})
    assert resp.choices[0].message.content == ANSWER
    assert "reasoning" not in (resp.choices[0].message.model_extra or {})


def test_k2_model_opens_the_block_itself(qwen3: ScriptedServer) -> None:
    """Qwen3 style: the output's ``<think>`` is a removed span too."""
    resp = _chat(qwen3)
    extra = resp.choices[0].message.model_extra or {}
    assert (extra["reasoning"], resp.choices[0].message.content) == (REASONING, ANSWER)
    split = resp.choices[0].model_extra["coda"]["reasoning"]
    assert split["opener"] == "<think>" and split["closer"] == "</think>"


def test_bad_budget_is_a_400(r1: ScriptedServer) -> None:
    client, model = oai(r1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MSG,
                                       extra_body={"max_reasoning_tokens": -1})


def claude(server: ScriptedServer) -> tuple[anthropic.Anthropic, str]:
    _, model = oai(server)
    return anthropic.Anthropic(base_url=server.url, api_key="k", max_retries=0), model


def test_k2_anthropic_thinking_block_then_text(r1: ScriptedServer) -> None:
    """Messages: a ``thinking`` block (empty signature) before the text block."""
    client, model = claude(r1)
    msg = client.messages.create(model=model, max_tokens=50, messages=MSG)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == REASONING and msg.content[0].signature == ""
    assert msg.content[1].text == ANSWER and msg.stop_reason == "end_turn"


def test_k2_anthropic_thinking_block_kept_with_tools(r1: ScriptedServer) -> None:
    """K2: with tools on, the whole answer keeps its ``thinking`` block before the text, as
    the stream sends it (the tool split rebuilt the content and dropped the thinking)."""
    client, model = claude(r1)
    tools: Any = [{"name": "get_weather", "description": "weather of a city",
                   "input_schema": {"type": "object",
                                    "properties": {"city": {"type": "string"}}}}]
    msg = client.messages.create(model=model, max_tokens=50, messages=MSG, tools=tools)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == REASONING and msg.content[1].text == ANSWER
    with client.messages.stream(model=model, max_tokens=50, messages=MSG,
                                tools=tools) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]


def test_anthropic_stream_thinking_deltas_and_budget(r1: ScriptedServer) -> None:
    """Streamed: content_block_start(thinking), thinking_delta, signature_delta, stop, then
    the text block; the budget (Coda's ``max_reasoning_tokens``: a ``budget_tokens`` is
    >= 1024, as Anthropic's) forces the closer; the SDK's accumulated message equals the
    parts."""
    client, model = claude(r1)
    with client.messages.stream(model=model, max_tokens=50, messages=MSG,
                                thinking={"type": "enabled"},  # type: ignore[typeddict-item]
                                extra_body={"max_reasoning_tokens": 1}) as stream:
        kinds = [(ev.type, getattr(getattr(ev, "delta", None), "type", None))
                 for ev in stream]
        final = stream.get_final_message()
    assert ("content_block_delta", "thinking_delta") in kinds
    assert kinds.index(("content_block_delta", "signature_delta")) < \
        kinds.index(("content_block_delta", "text_delta"))
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == " me" and final.content[1].text == ANSWER


def test_anthropic_thinking_disabled_drops_it(r1: ScriptedServer) -> None:
    client, model = claude(r1)
    msg = client.messages.create(model=model, max_tokens=50, messages=MSG,
                                 thinking={"type": "disabled"})
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ANSWER
    with client.messages.stream(model=model, max_tokens=50, messages=MSG,
                                thinking={"type": "disabled"}) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text"] and final.content[0].text == ANSWER


def test_k2_responses_reasoning_item_before_the_message(r1: ScriptedServer) -> None:
    """Responses: a ``reasoning`` output item (its text in content) before the message;
    streamed as response.reasoning_text.delta / .done, numbered without gaps, and the
    streamed parts equal the final object's."""
    client, model = oai(r1)
    resp = client.responses.create(model=model, input="hi")
    assert [o.type for o in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == REASONING
    assert resp.output_text == ANSWER
    assert resp.usage.output_tokens_details.reasoning_tokens == 3
    events = list(client.responses.create(model=model, input="hi", stream=True,
                                          extra_body={"max_reasoning_tokens": 1}))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response
    assert deltas == " me" == final.output[0].content[0].text
    assert final.output_text == ANSWER and final.output[1].type == "message"
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    assert added == [0, 1]


def test_responses_include_reasoning_false(r1: ScriptedServer) -> None:
    client, model = oai(r1)
    resp = client.responses.create(model=model, input="hi",
                                   extra_body={"include_reasoning": False})
    assert [o.type for o in resp.output] == ["message"] and resp.output_text == ANSWER


def test_anthropic_thinking_sent_back_is_accepted(r1: ScriptedServer) -> None:
    """A second turn carrying the first turn's thinking block (as the SDK's docs tell clients
    to) is accepted; the block is not prompt text."""
    client, model = claude(r1)
    first = client.messages.create(model=model, max_tokens=50, messages=MSG)
    history: list[Any] = [*MSG, {"role": "assistant",
                                 "content": [b.model_dump() for b in first.content]},
                          {"role": "user", "content": "more"}]
    again = client.messages.create(model=model, max_tokens=50, messages=history)
    assert again.content[-1].text == ANSWER


def test_reasoning_spec_without_markers() -> None:
    """A model without the markers: no split, and a budget is a 400 naming the field."""
    from coda.errors import InvalidRequestError
    from coda.reasoning import reasoning_spec
    from tests.scripted import scripted_tokenizer

    tok = scripted_tokenizer({101: b"a"})
    assert reasoning_spec(tok, [101], budget=None, budget_field="f") is None
    with pytest.raises(InvalidRequestError) as err:
        reasoning_spec(tok, [101], budget=3, budget_field="thinking.budget_tokens")
    assert err.value.field == "thinking.budget_tokens"
    marked = scripted_tokenizer({101: b"a"}, added={5: "<think>", 6: "</think>"})
    assert reasoning_spec(marked, [5], budget=None, budget_field="f") is not None


def test_k2_engine_trace_of_a_forced_close_checks(tmp_path: Path) -> None:
    """The batched engine's trace of a split output with a forced closer and a stop in the
    answer passes the trace checker (K2 removed markers, S2 holds, L6 returned tokens)."""
    from coda.engine.async_engine import AsyncEngine
    from coda.engine.types import EngineConfig, GenerationRequest
    from coda.reasoning import ReasoningSpec
    from coda.trace import ListTraceSink, check_trace
    from tests.reasoning_support import CLOSE_ID, ME
    from tests.wire_support import ScriptedRunner

    sink = ListTraceSink()
    engine = AsyncEngine.from_model_dir(reasoning_model_dir(tmp_path, inside=True),
                                        EngineConfig(num_blocks=64, max_num_seqs=4), trace=sink)
    engine.runner = engine.core.runner = ScriptedRunner(engine.runner, CHAIN, ME)
    engine.start()
    try:
        prompt = tuple(engine.tokenizer.encode("<|im_start|>assistant\n<think>\n").ids)
        spec = ReasoningSpec(inside=True, close_ids=(CLOSE_ID,), budget_tokens=1)
        handle = engine.submit(GenerationRequest(prompt, max_tokens=20, stop=("re",),
                                                 reasoning=spec))
        term = handle.wait(60)
    finally:
        engine.shutdown()
    assert term.reasoning is not None and term.reasoning.forced
    assert term.stop is not None and term.stop.stop == "re"
    assert check_trace(sink.events) == []


def test_p3_stream_verify_stamps_cover_both_parts(r1: ScriptedServer) -> None:
    """P3 ``stream_verify``: reasoning chunks are stamped like content chunks; the stamps are
    contiguous over reasoning + answer (the stream's bytes, markers removed)."""
    client, model = oai(r1)
    stamps, text = [], ""
    for chunk in client.chat.completions.create(model=model, messages=MSG, stream=True,
                                                extra_body={"stream_verify": True}):
        extra = chunk.model_extra or {}
        if not chunk.choices or "coda" not in extra or "offset" not in extra["coda"]:
            continue
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning") or delta.content or ""
        stamps.append((extra["coda"]["offset"], extra["coda"]["length"]))
        text += piece
    assert text == REASONING + ANSWER
    at = 0
    for offset, length in stamps:
        assert offset == at
        at += length
    assert at == len((REASONING + ANSWER).encode())


def test_k2_ollama_chat_and_generate_show_reasoning_as_thinking(r1: ScriptedServer) -> None:
    """Ollama (issue 23 items 2, 3): the split is ``message.thinking`` (chat) or ``thinking``
    (generate), whole and streamed, the content only the answer; ``think: false`` drops it."""
    import ollama

    client, model = ollama.Client(host=r1.url), oai(r1)[1]
    whole = client.chat(model=model, messages=MSG, think=True)
    assert (whole.message.thinking, whole.message.content) == (REASONING, ANSWER)
    thinking, content = [], []
    for part in client.chat(model=model, messages=MSG, think=True, stream=True):
        thinking.append(part.message.thinking or "")
        content.append(part.message.content)
        assert not (part.message.thinking and part.message.content)
    assert ("".join(thinking), "".join(content)) == (REASONING, ANSWER)
    gen = client.generate(model=model, prompt="hi", think=True)
    assert (gen.thinking, gen.response) == (REASONING, ANSWER)
    off = client.chat(model=model, messages=MSG, think=False)
    assert (off.message.thinking, off.message.content) == (None, ANSWER)


@pytest.mark.parametrize("think", [True, False])
def test_k2_ollama_logprobs_cover_the_reasoning_tokens_too(r1: ScriptedServer,
                                                           think: bool) -> None:
    """SPEC K2: Ollama ``logprobs`` hold every output token, the reasoning's included (shown
    or not, ``think``), streamed as whole: one entry per token but the EOS."""
    import ollama

    client, model = ollama.Client(host=r1.url), oai(r1)[1]
    whole = client.chat(model=model, messages=MSG, think=think, logprobs=True)
    streamed = [e for part in client.chat(model=model, messages=MSG, think=think,
                                          logprobs=True, stream=True)
                for e in (part.logprobs or [])]
    # NOTE: the scripted output ends on EOS, the one token never reported (S3)
    assert whole.logprobs is not None and len(whole.logprobs) == whole.eval_count - 1
    assert [e.token for e in whole.logprobs][:2] == [" me", " think"]
    assert [(e.token, e.logprob) for e in streamed] == [
        (e.token, e.logprob) for e in whole.logprobs]
