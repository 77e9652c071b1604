"""Leftovers of the OpenAI SDK sweep (SPEC P1, L6, S1), on each sweep model (SmolLM2, and
Gemma 3 270M where its GGUF is here) through the official ``openai`` (and ``anthropic``)
clients over loopback, every answer validated by the SDK's own types:

* Responses ``top_logprobs`` returns logprobs only with ``include:
  ["message.output_text.logprobs"]`` (as OpenAI: ``top_logprobs`` alone sets how many
  alternatives, and returns none); out of 0..20 it is a 400 naming it with OpenAI's code;
* ``/v1/embeddings`` input errors: an empty list, more than 2048 inputs, an empty string,
  mixed kinds — each a 400 naming ``input`` with a code;
* more than OpenAI's 4 stop strings are accepted and each stops the output; past the
  server's limit (``EngineConfig.max_stop_strings``) a 400 naming the field on every API.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pydantic
import pytest
from openai.types import CreateEmbeddingResponse
from openai.types.responses import Response, ResponseStreamEvent, ResponseTextDeltaEvent

from tests.openai_sweep_support import MODELS, U, bad, model_of, response_events, serve

EVENT: Any = pydantic.TypeAdapter(ResponseStreamEvent)
LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param)


def _events(oa: openai.OpenAI, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw ``data:`` objects of a streamed Responses create, each validated by the SDK."""
    return response_events(oa, body, EVENT.validate_python)


def _deltas(events: list[dict[str, Any]]) -> list[ResponseTextDeltaEvent]:
    return [ResponseTextDeltaEvent.model_validate(e) for e in events
            if e["type"] == "response.output_text.delta"]


def test_p1_l6_responses_logprobs_only_where_include_asks(oa: openai.OpenAI) -> None:
    """P1, L6: ``top_logprobs: 2`` alone: the response echoes it, and no part or delta
    carries logprobs (``[]``); with the ``include`` value every delta carries its tokens'
    entries with 2 alternatives each, and the final ``output_text`` all of them, in order."""
    body = {"model": model_of(oa), "input": "Say hi", "max_output_tokens": 16,
            "temperature": 0, "top_logprobs": 2}
    alone = Response.model_validate(oa.responses.create(**body).model_dump())
    assert alone.top_logprobs == 2 and alone.output_text
    assert alone.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    events = _events(oa, body)
    assert all(d.logprobs == [] for d in _deltas(events)) and _deltas(events)
    assert all(e.get("logprobs", []) == [] for e in events)
    asked = Response.model_validate(oa.responses.create(**body, include=LOGPROBS).model_dump())
    entries = asked.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert asked.output_text == alone.output_text and entries
    assert all(len(e.top_logprobs) == 2 for e in entries)
    assert b"".join(bytes(e.bytes) for e in entries) == asked.output_text.encode()
    deltas = _deltas(_events(oa, {**body, "include": LOGPROBS}))
    streamed = [lp for d in deltas for lp in d.logprobs]
    assert [(x.token, x.logprob) for x in streamed] == [(e.token, e.logprob) for e in entries]
    assert all(len(x.top_logprobs or ()) == 2 for x in streamed)


def test_p1_responses_top_logprobs_out_of_range_is_a_400_naming_it(oa: openai.OpenAI) -> None:
    """P1: ``top_logprobs`` outside 0..20 is a 400 naming it, with OpenAI's code
    (``integer_below_min_value`` / ``integer_above_max_value``); a number field out of its
    range is OpenAI's ``decimal_...`` (``temperature: 3`` too: a number field)."""
    for value, code in ((-1, "integer_below_min_value"), (21, "integer_above_max_value")):
        with pytest.raises(openai.BadRequestError) as exc:
            oa.responses.create(model=model_of(oa), input="hi", top_logprobs=value,
                                include=LOGPROBS)  # type: ignore[list-item]
        err: Any = exc.value.body
        assert (err["param"], err["code"]) == ("top_logprobs", code), err
        assert "top_logprobs" in err["message"] and str(value) in err["message"]
    # NOTE: a number field's bounds in OpenAI's words too: "decimal", whatever JSON number
    for field, value, code in (("temperature", 3, "decimal_above_max_value"),
                               ("temperature", 2.5, "decimal_above_max_value"),
                               ("top_p", -0.5, "decimal_below_min_value"),
                               ("n", 17, "integer_above_max_value")):
        with pytest.raises(openai.BadRequestError) as exc:
            oa.chat.completions.create(model=model_of(oa), messages=U, max_tokens=1,
                                       extra_body={field: value})
        err = exc.value.body
        assert (err["param"], err["code"]) == (field, code), err
        assert err["message"].startswith(f"{field}: {code.split('_')[0]} ")
        assert f"but got {value} instead" in err["message"] and ".0," not in err["message"]


def test_p1_embedding_inputs_refused_with_a_named_field_and_a_code(oa: openai.OpenAI) -> None:
    """P1: each bad ``input`` is a 400 naming ``input`` with a code: an empty list
    (``empty_array``), 2049 inputs (``array_above_max_length``), an empty string, an empty
    token-id list, and lists mixing strings, token ids and token-id lists; a list of
    token-id lists is embedded (the SDK's ``CreateEmbeddingResponse``), and one list of 2049
    token ids is one input (refused for the context, not as 2049 inputs)."""
    model = model_of(oa)
    cases: list[tuple[Any, str | None, str]] = [
        ([], "empty_array", "empty array"),
        (["a"] * 2049, "array_above_max_length", "maximum length 2048"),
        ("", None, "empty"), ([[]], None, "empty"),
        ([1, "a"], None, "one kind"), ([[1, 2], "a"], None, "one kind"),
        ([1, [2]], None, "one kind"), ([1.5], None, "token ids")]
    for value, code, words in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            oa.embeddings.create(model=model, input=value, encoding_format="float")
        err: Any = exc.value.body
        assert err["param"] == "input" and words in err["message"], (value, err)
        assert err["code"] == code if code else err["code"], (value, err)
    # NOTE: one token-id list is one input: past the context (1024), not "2049 inputs"
    with pytest.raises(openai.BadRequestError) as exc:
        oa.embeddings.create(model=model, input=[1] * 2049, encoding_format="float")
    err = exc.value.body
    assert (err["param"], err["code"]) == ("input", "context_length_exceeded"), err
    one = oa.embeddings.create(model=model, input=[1] * 900, encoding_format="float")
    assert len(one.data) == 1 and one.usage.prompt_tokens == 900
    ok = oa.embeddings.create(model=model, input=[[1, 2, 3], [4, 5]], encoding_format="float")
    made = CreateEmbeddingResponse.model_validate(ok.model_dump())
    assert [d.index for d in made.data] == [0, 1] and made.usage.prompt_tokens == 5


def test_s1_more_stop_strings_than_openais_four_each_stop(oa: openai.OpenAI) -> None:
    """S1: 5 stop strings (OpenAI documents up to 4) are accepted, and the 5th stops the
    output as the 1st would; 17 (past ``max_stop_strings``, 16) is a 400 naming ``stop`` on
    chat and Responses, ``stop_sequences`` on Anthropic's Messages."""
    model = model_of(oa)
    free = oa.chat.completions.create(model=model, messages=U, max_tokens=12, temperature=0)
    text = free.choices[0].message.content or ""
    cut = text.strip().split()[-1] if len(text.split()) > 1 else text[-1]
    stops = ["\x01q", "\x01r", "\x01s", "\x01t", cut]
    got = oa.chat.completions.create(model=model, messages=U, max_tokens=12, temperature=0,
                                     stop=stops)
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].message.content == text[:text.index(cut)]
    many = [f"\x01{i}" for i in range(17)]
    bad(lambda: oa.chat.completions.create(model=model, messages=U, stop=many), "stop")
    bad(lambda: oa.responses.create(model=model, input="hi", extra_body={"stop": many}), "stop")
    claude = anthropic.Anthropic(base_url=str(oa.base_url).removesuffix("/v1/"), api_key="k",
                                 max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model=model, max_tokens=8, messages=U, stop_sequences=many)
    assert "stop_sequences" in exc.value.message
