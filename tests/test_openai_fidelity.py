"""OpenAI API fidelity on SmolLM2 and Gemma 3 270M, with the official ``openai`` client over
loopback (SPEC P1): rules OpenAI applies before generating (the Responses budget floor, the
word "json" for ``json_object``), ``system_fingerprint`` and the chat message's ``refusal`` /
``annotations``, and the newer request fields (``prompt_cache_retention``, chat
``prediction``, Responses ``max_tool_calls``) accepted, checked and, where they change the
output, honoured."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.openai_sweep_support import MODELS, RS_TOOLS, U, serve
from tests.openai_sweep_support import bad as _bad
from tests.openai_sweep_support import model_of as _model


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param)


def _err(exc: pytest.ExceptionInfo[openai.BadRequestError]) -> dict[str, Any]:
    body: Any = exc.value.body
    return dict(body)


def test_p1_responses_max_output_tokens_below_16_is_openais_400(oa: openai.OpenAI) -> None:
    """P1: as OpenAI, Responses refuses ``max_output_tokens`` under 16 (400
    ``integer_below_min_value`` naming the field); 16 is served, and Chat / Completions keep
    any positive budget."""
    m = _model(oa)
    for value in (1, 15):
        with pytest.raises(openai.BadRequestError) as exc:
            oa.responses.create(model=m, input="hi", max_output_tokens=value)
        body = _err(exc)
        assert body["param"] == "max_output_tokens", body
        assert body["code"] == "integer_below_min_value", body
        assert body["message"].startswith("max_output_tokens:"), body
        assert "Expected a value >= 16" in body["message"], body
    assert oa.responses.create(model=m, input="hi", max_output_tokens=16).usage.output_tokens <= 16  # type: ignore[union-attr]
    assert oa.chat.completions.create(model=m, messages=U, max_tokens=1).usage.completion_tokens == 1  # type: ignore[union-attr]
    assert oa.completions.create(model=m, prompt="hi", max_tokens=1).usage.completion_tokens == 1  # type: ignore[union-attr]


def test_p1_json_object_needs_the_word_json(oa: openai.OpenAI) -> None:
    """P1: ``json_object`` without the word "json" (any case) in the messages is OpenAI's
    400 naming ``messages`` (Chat) / ``input`` (Responses, which also reads
    ``instructions``); with it, the request is served."""
    m = _model(oa)
    fmt: Any = {"type": "json_object"}
    msg = _bad(lambda: oa.chat.completions.create(model=m, messages=U, max_tokens=8,
                                                  response_format=fmt), "messages")
    assert "must contain the word 'json'" in msg
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            oa.chat.completions.create(model=m, messages=U, max_tokens=8, stream=stream,
                                       response_format=fmt)
    asked: Any = [{"role": "system", "content": "Answer in JSON."}, *U]
    ok = oa.chat.completions.create(model=m, messages=asked, max_tokens=8, response_format=fmt)
    assert ok.choices[0].message.content is not None
    parts: Any = [{"role": "user", "content": [{"type": "text", "text": "a Json please"}]}]
    assert oa.chat.completions.create(model=m, messages=parts, max_tokens=8,
                                      response_format=fmt).choices
    text: Any = {"format": fmt}
    msg = _bad(lambda: oa.responses.create(model=m, input="hi", max_output_tokens=16,
                                           text=text), "input")
    assert "must contain the word 'json'" in msg
    r = oa.responses.create(model=m, input="hi", instructions="reply with JSON",
                            max_output_tokens=16, text=text)
    assert r.text.format.type == "json_object"  # type: ignore[union-attr]
    assert oa.responses.create(model=m, input=[{"role": "user", "content": "json?"}],
                               max_output_tokens=16, text=text).id


def test_p1_system_fingerprint_and_the_message_fields(oa: openai.OpenAI) -> None:
    """P1: ``system_fingerprint`` (``fp_`` + 10 hex digits of the model's identity) on
    ``chat.completion``, every chunk and ``text_completion``, the same on every answer of
    one model; the chat message carries ``refusal: null`` and ``annotations: []``, and the
    first chunk's delta ``refusal: null``, as OpenAI's do."""
    m = _model(oa)
    chat = oa.chat.completions.create(model=m, messages=U, max_tokens=3)
    fp = chat.system_fingerprint
    assert fp is not None and re.fullmatch(r"fp_[0-9a-f]{10}", fp), fp
    message = chat.choices[0].message
    assert message.refusal is None and message.annotations == []
    raw = oa.chat.completions.with_raw_response.create(model=m, messages=U, max_tokens=3)
    got: Any = raw.http_response.json()
    assert got["choices"][0]["message"]["refusal"] is None
    assert got["choices"][0]["message"]["annotations"] == []
    assert got["system_fingerprint"] == fp
    chunks = list(oa.chat.completions.create(model=m, messages=U, max_tokens=3, stream=True,
                                             stream_options={"include_usage": True}))
    assert chunks and all(c.system_fingerprint == fp for c in chunks)
    first: Any = chunks[0].choices[0].delta
    assert first.role == "assistant" and "refusal" in first.model_fields_set
    legacy = oa.completions.create(model=m, prompt="hi", max_tokens=2)
    assert legacy.system_fingerprint == fp
    assert all(c.system_fingerprint == fp for c in
               oa.completions.create(model=m, prompt="hi", max_tokens=2, stream=True))


def test_p1_prompt_cache_retention_is_accepted_and_checked(oa: openai.OpenAI) -> None:
    """P1: ``prompt_cache_retention`` ("in-memory" | "24h") is accepted on Chat and Responses
    (no effect: Coda's prefix cache is automatic), Responses echoes it; another value is a
    400 naming it."""
    m = _model(oa)
    for value in ("in-memory", "24h"):
        assert oa.chat.completions.create(model=m, messages=U, max_tokens=2,
                                          prompt_cache_retention=value).choices
        r = oa.responses.create(model=m, input="hi", max_output_tokens=16,
                                prompt_cache_retention=value)
        assert r.prompt_cache_retention == value
    base = str(oa.base_url).rstrip("/")
    for path, body in (("/chat/completions", {"messages": U, "max_tokens": 2}),
                       ("/responses", {"input": "hi", "max_output_tokens": 16})):
        resp = httpx.post(base + path, json={"model": m, **body,
                                             "prompt_cache_retention": "forever"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == "prompt_cache_retention"


def test_p1_chat_prediction_is_accepted_checked_and_counted(oa: openai.OpenAI) -> None:
    """P1, O1: chat ``prediction`` ({type: content, content: text or text parts}) is served
    with the output it would have without it, and usage reports ``accepted_prediction_tokens``
    / ``rejected_prediction_tokens`` (they add up to the prediction's tokens; text parts count
    as their joined text); a bad shape is a 400 naming ``prediction``."""
    m = _model(oa)
    plain_text = oa.chat.completions.create(model=m, messages=U, max_tokens=4,
                                            temperature=0).choices[0].message.content
    counts = []
    for content in ("Hello there", [{"type": "text", "text": "Hello"},
                                    {"type": "text", "text": " there"}]):
        pred: Any = {"type": "content", "content": content}
        r = oa.chat.completions.create(model=m, messages=U, max_tokens=4, prediction=pred,
                                       temperature=0)
        assert r.choices[0].message.content == plain_text
        details: Any = r.usage.completion_tokens_details  # type: ignore[union-attr]
        counts.append((details.accepted_prediction_tokens, details.rejected_prediction_tokens))
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens >= 2
    assert counts[0] == counts[1]
    chunks = list(oa.chat.completions.create(
        model=m, messages=U, max_tokens=4, stream=True, stream_options={"include_usage": True},
        prediction={"type": "content", "content": "Hello there"}, temperature=0))
    usage: Any = chunks[-1].usage
    assert (usage.completion_tokens_details.accepted_prediction_tokens,
            usage.completion_tokens_details.rejected_prediction_tokens) == counts[0]
    plain = oa.chat.completions.create(model=m, messages=U, max_tokens=4)
    assert plain.usage is not None and plain.usage.completion_tokens_details is None
    base = str(oa.base_url).rstrip("/")
    for bad in ({"type": "text", "content": "x"}, {"content": "x"}, {"type": "content"},
                {"type": "content", "content": [{"type": "image_url", "image_url": "u"}]},
                {"type": "content", "content": 3}, "x"):
        resp = httpx.post(base + "/chat/completions", json={
            "model": m, "messages": U, "max_tokens": 2, "prediction": bad})
        assert resp.status_code == 400, (bad, resp.text)
        assert resp.json()["error"]["param"].startswith("prediction"), resp.text


def _calls(r: Any) -> int:
    return sum(o.type == "function_call" for o in r.output)


def test_p1_responses_max_tool_calls_bounds_the_calls(oa: openai.OpenAI) -> None:
    """P1: Responses ``max_tool_calls`` is the most function calls the output holds (the
    tool grammar admits no more; streamed the same), echoed on the response; 0 is no call
    (a required call with 0 is a 400 naming it); a negative value is a 400."""
    m = _model(oa)
    ask = "Call f with x=1, then f with x=2, then g with x=3, then g with x=4."
    kw: Any = {"model": m, "input": ask, "tools": RS_TOOLS, "tool_choice": "required",
               "max_output_tokens": 200, "temperature": 1.0}
    # NOTE: seeds where the model makes more than one call unbounded (SmolLM2: seed 0 makes 3)
    many = [s for s in range(4) if _calls(oa.responses.create(**kw, extra_body={"seed": s})) > 1]
    if not many:
        pytest.skip("this model makes one call at most here")
    for seed in many:
        one = oa.responses.create(**kw, max_tool_calls=1, extra_body={"seed": seed})
        assert _calls(one) == 1 and one.max_tool_calls == 1
        events = list(oa.responses.create(**kw, max_tool_calls=1, stream=True,
                                          extra_body={"seed": seed}))
        done: Any = events[-1]
        assert _calls(done.response) == 1
    auto = {**kw, "tool_choice": "auto"}
    assert _calls(oa.responses.create(**auto, max_tool_calls=0, extra_body={"seed": many[0]})) == 0
    _bad(lambda: oa.responses.create(**kw, max_tool_calls=0), "max_tool_calls")
    _bad(lambda: oa.responses.create(**kw, max_tool_calls=-1), "max_tool_calls")
