"""No field accepted and ignored (issue 14 item 5; SPEC P1, P3, L6): each field is honoured or
refused with a 400 naming it, through the official ``openai`` and ``anthropic`` clients."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anthropic
import httpx
import openai
import pytest

from coda.server.chat import render_chat

MODEL = "tiny-chat"
MSG = [{"role": "user", "content": "Hello world"}]


@pytest.fixture
def client(server_live: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server_live.url + "/v1", api_key="unused", max_retries=0)


def _gone(server_live: Any, rid: str) -> bool:
    end = time.monotonic() + 10
    while server_live.app.state.coda.store.get(rid) is not None:
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True


def test_p3_responses_store_false_is_never_retrievable_nor_kept(
        server_live: Any, client: openai.OpenAI) -> None:
    """P3 (privacy): ``store: false`` — the response is not retrievable by id and nothing of it
    is kept once it ended, streamed or not; ``store`` defaults to true (retrievable)."""
    kept = client.responses.create(model=MODEL, input="hi", max_output_tokens=16)
    assert kept.store is True and client.responses.retrieve(kept.id).id == kept.id
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=16, store=False)
    assert r.store is False and r.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    assert _gone(server_live, r.id)
    with client.responses.create(model=MODEL, input="hi", max_output_tokens=16, store=False,
                                 stream=True) as stream:
        events = list(stream)
    rid = events[0].response.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(rid)
    assert _gone(server_live, rid)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL, input="hi", store=False, background=True)
    assert exc.value.body["param"] == "background"  # type: ignore[index]


def test_p1_responses_truncation_is_honoured_and_echoed(client: openai.OpenAI) -> None:
    """P1: ``truncation`` is honoured either way (``"auto"`` drops the oldest input items only
    past the context: tests/test_server_responses_truncation.py) and echoed as sent."""
    for mode in ("auto", "disabled"):
        r = client.responses.create(model=MODEL, input="hi", max_output_tokens=16,
                                    truncation=mode)  # type: ignore[arg-type]
        assert r.truncation == mode


def test_p1_stream_options_without_stream_is_400(client: openai.OpenAI) -> None:
    """P1: as OpenAI, ``stream_options`` with ``stream: false`` is a 400 naming the field."""
    for call in (lambda: client.chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=2, stream_options={"include_usage": True}),
            lambda: client.completions.create(
            model=MODEL, prompt="hi", max_tokens=2, stream_options={"include_usage": True})):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.body["param"] == "stream_options"  # type: ignore[index]


def test_l6_continuous_usage_stats_puts_usage_on_every_chunk(client: openai.OpenAI) -> None:
    """L6: ``stream_options.continuous_usage_stats`` (vLLM): every chunk carries the usage so
    far; completion tokens never decrease and end at the selected (billed) tokens."""
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=8, stream=True, n=2,
        extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    per_choice: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        assert c.usage is not None, c
        if c.choices and c.choices[0].delta.content:
            per_choice[c.choices[0].index].append(c.usage.completion_tokens)
        if c.choices and c.choices[0].finish_reason is not None:
            assert c.usage.completion_tokens == \
                c.model_extra["coda"]["usage"]["selected_tokens"] == 8
    for counts in per_choice.values():
        assert counts and counts == sorted(counts) and counts[-1] <= 8
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16


def test_p1_chat_message_name_reaches_the_template(server_live: Any,
                                                   client: openai.OpenAI) -> None:
    """P1: a message's ``name`` is passed to the chat template as transformers does (a
    template that uses it renders it; ChatML ignores it), never silently dropped; a non-string
    name is a 400 naming it."""

    template = "{% for m in messages %}[{{ m.name }}]{{ m.content }}{% endfor %}"
    engine = SimpleNamespace(chat=SimpleNamespace(chat_template=template, bos_token="",
                                                  eos_token=""))
    text = render_chat(engine, [{"role": "user", "content": "hi", "name": "ada"}],
                       add_generation_prompt=False)
    assert text == "[ada]hi"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi", "name": "ada"}], max_tokens=2)
    assert r.choices[0].message.role == "assistant"
    bad = httpx.post(server_live.url + "/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi", "name": 7}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.name"


def test_p1_harmless_metadata_and_anthropic_cache_control_are_accepted(
        server_live: Any, client: openai.OpenAI) -> None:
    """P1: ``user`` / ``metadata`` are accepted (documented as informational); Anthropic SDK
    2.x's top-level ``cache_control`` is accepted (prefix caching is automatic), and so is
    ``cache_control`` on system and content blocks."""
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, user="u-1",
                                       metadata={"k": "v"})
    assert r.choices
    ac = anthropic.Anthropic(base_url=server_live.url, api_key="unused", max_retries=0)
    m = ac.messages.create(
        model=MODEL, max_tokens=2, metadata={"user_id": "u-1"},
        system=[{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}],
        extra_body={"cache_control": {"type": "ephemeral"}})
    assert m.role == "assistant"


# --------------------------------------------------------------------------- logprobs (item 3)
def test_p1_l6_responses_final_output_text_carries_the_logprobs(
        server_live: Any, client: openai.OpenAI) -> None:
    """P1/L6: with ``top_logprobs`` and ``include``, the final ``output_text`` (non-streamed,
    retrieved, and in ``output_text.done`` / ``content_part.done`` / the terminal response)
    carries every returned token's logprobs — the same entries the deltas carried."""
    # NOTE: greedy, so the run is reproducible: a sampled special token (<unk>) has bytes in
    # its logprobs entry but no text, which made the bytes-equal-text check below flaky
    kw: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 16,
                          "top_logprobs": 2, "include": ["message.output_text.logprobs"],
                          "temperature": 0, "extra_body": {"ignore_eos": True}}
    r = client.responses.create(**kw)
    final = r.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert len(final) == 16 and all(len(e.top_logprobs) == 2 for e in final)
    # NOTE: each entry's bytes are the token's exact bytes in context (issue 11 item 4): a
    # Metaspace token keeps its leading space, so the bytes concatenate to the output text
    assert b"".join(bytes(e.bytes) for e in final).decode() == r.output_text
    got = client.responses.retrieve(r.id).output[0].content[0].logprobs  # type: ignore[union-attr]
    assert [e.model_dump() for e in got] == [e.model_dump() for e in final]
    with client.responses.create(stream=True, **kw) as stream:
        events = list(stream)
    deltas = [e.model_dump() for ev in events if ev.type == "response.output_text.delta"
              for e in ev.logprobs]
    assert len(deltas) == 16
    done = next(ev for ev in events if ev.type == "response.output_text.done")
    part = next(ev for ev in events if ev.type == "response.content_part.done")
    last = events[-1].response.output[0].content[0]  # type: ignore[union-attr]
    for entries in (done.logprobs, part.part.logprobs, last.logprobs):  # type: ignore[union-attr]
        assert [e.model_dump() for e in entries] == deltas


def test_p1_completions_text_offset_skips_special_tokens(server_engine: Any,
                                                         client: openai.OpenAI) -> None:
    """P1: legacy ``text_offset`` is each token's start in the returned text; a special token
    the request skips adds no text, so it does not move the offset — streamed and not."""
    tok = server_engine.tokenizer
    special = tok.token_to_id("<|im_start|>")
    bias = {str(tok.token_to_id(t)): 100 for t in (".", "x")} | {str(special): 100}
    kw: dict[str, Any] = {"model": MODEL, "prompt": "Hello", "max_tokens": 16, "logprobs": 0,
                          "seed": 3, "temperature": 1.0, "logit_bias": bias,
                          "extra_body": {"ignore_eos": True}}
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.text_offset is not None
    assert "<|im_start|>" in lp.tokens and len(set(lp.tokens)) > 1
    expected, at = [], 0
    for t in lp.tokens:
        expected.append(at)
        at += 0 if t == "<|im_start|>" else len(t)
    assert lp.text_offset == expected
    assert at == len(r.choices[0].text)
    offsets: list[int] = []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            offsets += chunk.choices[0].logprobs.text_offset or []
    assert offsets == expected


def test_p3_chat_store_false_is_not_kept_for_resume(server_live: Any,
                                                    client: openai.OpenAI) -> None:
    """P3 (privacy): chat ``store: false`` — once the completion ended it is not kept, so
    ``/v1/streams/{id}`` is a 404; by default it stays resumable."""
    kept = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2)
    assert httpx.get(f"{server_live.url}/v1/streams/{kept.id}").status_code == 200
    r = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=2, store=False)
    assert _gone(server_live, r.id)
    assert httpx.get(f"{server_live.url}/v1/streams/{r.id}").status_code == 404
