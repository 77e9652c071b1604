"""A demanding OpenAI user's sweep of the Responses surface and chat's less-probed fields
(SPEC P1, P3), through the official ``openai`` client over loopback on SmolLM2 and Gemma 3
270M (GGUF; skipped where its file is absent), every answer parsed into the SDK's own
pydantic types with ``model_validate`` (the SDK itself builds its objects without
validation, so a missing required field only shows there). Found:

- Responses ``usage.input_tokens_details`` lacked ``cache_write_tokens``, which the SDK's
  ``InputTokensDetails`` requires: ``Response.model_validate`` of any created, retrieved or
  streamed terminal response failed, and ``usage.input_tokens_details.cache_write_tokens``
  read ``None`` where the type says ``int``.
- Responses ``input``: sending an output back as input (OpenAI's manual conversation state,
  ``input += response.output``) was a 400 whenever the output held a ``reasoning`` item
  (what Coda answers on a reasoning model); any item Coda does not take (``item_reference``,
  a message without ``role``, a bare string) was refused as ``input: Input should be a
  valid string``, naming neither the item nor what is wrong with it.
- OpenAI fields for what only OpenAI's servers do (chat ``audio``, ``web_search_options``;
  Responses ``conversation``, ``prompt``) were "Unrecognized request argument supplied",
  which reads as a typo or an outdated server; ``prompt`` sent alone (a stored template
  instead of ``input``) was even answered ``input: Field required``.
- A cancelled response carried ``incomplete_details: {"reason": "cancelled"}`` and a
  deadline or disconnect ``"deadline_exceeded"`` / ``"transport_error"``: none is a value of
  the SDK's ``IncompleteDetails.reason`` (a closed literal), so ``Response.model_validate``
  failed and typed clients of other languages reject the enum. OpenAI's cancelled response
  has no ``incomplete_details``; a truncation's closest value is ``max_output_tokens``.
- ``/v1/embeddings`` with an input past the context answered ``code: invalid_request``
  where a chat or Responses prompt past it answers ``context_length_exceeded`` (what
  clients test to split an input and retry).
- ``client.responses.input_tokens.count`` (``POST /v1/responses/input_tokens``) was a 405
  "Method Not Allowed" (the path read as a response id): now the count of the prompt the
  create would build from the same fields.
- ``client.models.retrieve`` of an id with a slash (an HF ``org/name``, the GGUF path given
  to ``--model``, which every create takes as ``model``) was the router's bare 404 "Not
  Found": the SDK sends the slash as ``%2F``, decoded before routing.
- ``client.responses.compact`` was a 405 "Method Not Allowed" (read as a response id),
  which suggests another method would work; compaction is not offered: a 404 saying so and
  what to do instead.
- An assistant message whose content holds a ``refusal`` part (OpenAI's assistant content
  is text or refusal parts; chat and Responses) was a 400 "only text content parts"; one
  sent back with its ``refusal`` field and no content (the SDK's message as it came) lost
  what the assistant said: the turn rendered empty.
- A Responses tool in Chat Completions' nested shape (``{"type": "function", "function":
  {...}}``, the usual slip when moving to Responses) was "tools.0.name must match ...,
  got None", and chat's flat one "tools.0.function: required": neither said that the
  tool had the other API's shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

from tests.openai_sweep_support import GEMMA, MODELS, RS_TOOLS, TOOLS, bad, response_events, serve
from tests.openai_sweep_support import model_of as _model

EVENT: Any = pydantic.TypeAdapter(ResponseStreamEvent)
ITEM: Any = pydantic.TypeAdapter(ResponseItem)
# NOTE: what a reasoning model's output carries (coda.server.responses_object.reasoning_item)
THOUGHT: Any = {"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
                "content": [{"type": "reasoning_text", "text": "The user greets me."}]}


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param)


def _events(oa: openai.OpenAI, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The raw ``data:`` objects of a streamed create, as the server wrote them."""
    return response_events(oa, body)


def test_p1_responses_validate_as_the_sdks_types(oa: openai.OpenAI) -> None:
    """P1, P3: a created, a retrieved and a streamed response (every event) validate as the
    SDK's ``Response`` / ``ResponseStreamEvent``; the usage's token counts agree."""
    body = {"model": _model(oa), "input": "Say hi", "max_output_tokens": 16}
    raw = oa.responses.with_raw_response.create(**body)
    made = Response.model_validate(json.loads(raw.text))
    assert made.usage is not None
    details = made.usage.input_tokens_details
    assert details.cache_write_tokens == 0 and details.cached_tokens >= 0
    assert made.usage.total_tokens == made.usage.input_tokens + made.usage.output_tokens
    got = oa.responses.with_raw_response.retrieve(made.id)
    assert Response.model_validate(json.loads(got.text)).usage == made.usage
    events = _events(oa, body)
    for e in events:
        EVENT.validate_python(e)
    final = Response.model_validate(events[-1]["response"])
    assert final.usage is not None and final.usage.input_tokens_details.cache_write_tokens == 0
    assert final.usage.output_tokens <= 16


def test_p1_an_output_with_reasoning_goes_back_as_input(oa: openai.OpenAI) -> None:
    """P1: ``input += response.output`` with a reasoning item among the output: accepted,
    left out of the prompt (the same input tokens as without it, as a
    ``previous_response_id`` continuation), and listed by ``input_items`` as a reasoning
    item the SDK's types read."""
    m = _model(oa)
    first = oa.responses.create(model=m, input="Say hi", max_output_tokens=16)
    turn: Any = [{"role": "user", "content": "Say hi"}]
    after: Any = [*[o.model_dump() for o in first.output], {"role": "user", "content": "Again"}]
    with_thought = oa.responses.create(model=m, input=[*turn, THOUGHT, *after],
                                       max_output_tokens=16)
    without = oa.responses.create(model=m, input=[*turn, *after], max_output_tokens=16)
    assert with_thought.usage is not None and without.usage is not None
    assert with_thought.usage.input_tokens == without.usage.input_tokens
    raw = oa.responses.input_items.with_raw_response.list(with_thought.id, order="asc")
    items = json.loads(raw.text)["data"]
    assert [i["type"] for i in items][:2] == ["message", "reasoning"]
    assert items[1]["id"] == "rs_1"
    for item in items:
        ITEM.validate_python(item)


def test_p1_an_input_item_coda_does_not_take_is_named(oa: openai.OpenAI) -> None:
    """P1: a 400 naming the item and what is wrong with it, never ``input`` as a string."""
    m, hi = _model(oa), {"role": "user", "content": "hi"}
    ref: Any = [hi, {"type": "item_reference", "id": "msg_1"}]
    msg = bad(lambda: oa.responses.create(model=m, input=ref), "input.1.type")
    assert "item_reference" in msg
    roleless: Any = [{"type": "message", "content": "hi"}]
    bad(lambda: oa.responses.create(model=m, input=roleless), "input.0.role")
    bare: Any = [hi, "hi"]
    assert "must be an object" in bad(lambda: oa.responses.create(model=m, input=bare),
                                      "input.1")


def test_p1_openai_only_features_are_named_with_what_to_do(oa: openai.OpenAI) -> None:
    """P1: each a 400 naming the field and saying what to send instead."""
    m, u = _model(oa), [{"role": "user", "content": "hi"}]
    voice: Any = {"voice": "alloy", "format": "wav"}
    msg = bad(lambda: oa.chat.completions.create(model=m, messages=u, audio=voice,
                                                 modalities=["text", "audio"]), "audio")
    assert "audio output is not supported" in msg
    assert "not offered" in bad(lambda: oa.chat.completions.create(
        model=m, messages=u, web_search_options={}), "web_search_options")
    msg = bad(lambda: oa.responses.create(model=m, input="hi", conversation="conv_1"),
              "conversation")
    assert "previous_response_id" in msg
    template: Any = {"id": "pmpt_1"}
    assert "input" in bad(lambda: oa.responses.create(model=m, prompt=template), "prompt")


def test_p1_cancelled_and_cut_responses_validate(oa: openai.OpenAI) -> None:
    """P1, C1: a cancelled background response is ``cancelled`` without
    ``incomplete_details``; one cut by its ``deadline`` is ``incomplete`` with
    ``max_output_tokens``, the exact reasons in ``coda``; both validate as the SDK's."""
    m = _model(oa)
    started = oa.responses.create(model=m, input="Write a long story", background=True,
                                  max_output_tokens=900, extra_body={"ignore_eos": True})
    raw = oa.responses.with_raw_response.cancel(started.id)
    gone = Response.model_validate(json.loads(raw.text))
    assert gone.status == "cancelled" and gone.incomplete_details is None
    assert (gone.model_extra or {})["coda"]["finish_reason"] == "cancelled"
    raw = oa.responses.with_raw_response.create(
        model=m, input="Write a long story", max_output_tokens=900,
        extra_body={"ignore_eos": True, "deadline": 0.3})
    cut = Response.model_validate(json.loads(raw.text))
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert (cut.model_extra or {})["coda"]["finish_reason"] == "deadline_exceeded"


def test_p1_an_embedding_input_past_the_context_is_context_length_exceeded(
        oa: openai.OpenAI) -> None:
    """P1: text or token ids past the context: the chat prompt's 400 code, naming ``input``."""
    m = _model(oa)
    for long in ("word " * 1100, list(range(1, 1100))):
        with pytest.raises(openai.BadRequestError) as exc:
            oa.embeddings.create(model=m, input=long)
        assert exc.value.code == "context_length_exceeded" and exc.value.param == "input"
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=m, messages=[{"role": "user", "content": "word " * 1100}])
    assert exc.value.code == "context_length_exceeded"


def test_p1_responses_input_tokens_count_what_the_create_bills(oa: openai.OpenAI) -> None:
    """P1: ``responses.input_tokens.count`` answers OpenAI's object with the create's
    ``usage.input_tokens`` for the same input, instructions, tools and continuation; its
    fields are checked as the create's (unknown model 404, no input 400)."""
    m = _model(oa)
    asks: list[dict[str, Any]] = [
        {"input": "Say hi"},
        {"input": [{"role": "user", "content": "Say hi"}], "instructions": "Be terse."},
        {"input": "Call f with x=1", "tools": RS_TOOLS, "tool_choice": "auto"}]
    first = oa.responses.create(model=m, input="My name is Bob.", max_output_tokens=16)
    asks.append({"input": "What is my name?", "previous_response_id": first.id})
    for ask in asks:
        made = oa.responses.create(model=m, max_output_tokens=16, **ask)
        raw = oa.responses.input_tokens.with_raw_response.count(model=m, **ask)
        counted = json.loads(raw.text)
        assert counted["object"] == "response.input_tokens"
        assert made.usage is not None and counted["input_tokens"] == made.usage.input_tokens
    assert oa.responses.input_tokens.count(input="Say hi").input_tokens > 0
    with pytest.raises(openai.NotFoundError):
        oa.responses.input_tokens.count(model="nope", input="hi")
    bad(lambda: oa.responses.input_tokens.count(model=m), "input")


def test_p1_models_retrieve_takes_ids_with_slashes(oa: openai.OpenAI) -> None:
    """P1: an unknown ``org/name`` is OpenAI's model 404 (``model_not_found``, naming
    ``model``); on Gemma the path given to ``--model`` retrieves the served card, as a create
    takes it."""
    with pytest.raises(openai.NotFoundError) as exc:
        oa.models.retrieve("org/nope")
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    served = _model(oa)
    if served.startswith("gemma3"):
        assert oa.models.retrieve(str(GEMMA)).id == served


def test_p1_responses_compact_is_refused_saying_what_to_do(oa: openai.OpenAI) -> None:
    """P1: OpenAI's 404 shape, naming the endpoint and pointing to ``truncation``."""
    with pytest.raises(openai.NotFoundError) as exc:
        oa.responses.compact(model=_model(oa), input="hi")
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error" and "truncation" in body["message"]


def test_p1_an_assistant_refusal_part_is_what_it_said(oa: openai.OpenAI) -> None:
    """P1: chat and Responses take an assistant's ``refusal`` part as its text (the same
    prompt as a text part); on a user message it stays a 400 naming the content."""
    m, said = _model(oa), "I cannot help with that."
    def turns(part: dict[str, str]) -> Any:
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]},
                {"role": "user", "content": "ok"}]
    refused, text = {"type": "refusal", "refusal": said}, {"type": "text", "text": said}
    a = oa.chat.completions.create(model=m, messages=turns(refused), max_tokens=2)
    b = oa.chat.completions.create(model=m, messages=turns(text), max_tokens=2)
    field: Any = [{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": None, "refusal": said},
                  {"role": "user", "content": "ok"}]
    e = oa.chat.completions.create(model=m, messages=field, max_tokens=2)
    assert a.usage is not None and b.usage is not None and e.usage is not None
    assert a.usage.prompt_tokens == b.usage.prompt_tokens == e.usage.prompt_tokens
    out = {"type": "output_text", "text": said}
    c = oa.responses.create(model=m, input=turns(refused), max_output_tokens=16)
    d = oa.responses.create(model=m, input=turns(out), max_output_tokens=16)
    assert c.usage is not None and d.usage is not None
    assert c.usage.input_tokens == d.usage.input_tokens
    user: Any = [{"role": "user", "content": [refused]}]
    bad(lambda: oa.chat.completions.create(model=m, messages=user), "messages.0.content.0")


def test_p1_a_tool_in_the_other_apis_shape_says_so(oa: openai.OpenAI) -> None:
    """P1: each API's 400 names the tool and shows both shapes."""
    m = _model(oa)
    msg = bad(lambda: oa.responses.create(model=m, input="hi", tools=TOOLS), "tools.0")
    assert msg.startswith("tools.0.name: required") and "Chat Completions nests" in msg
    msg = bad(lambda: oa.chat.completions.create(model=m, messages=[{"role": "user",
                                                 "content": "hi"}], tools=RS_TOOLS), "tools.0")
    assert msg.startswith("tools.0.function: required") and "Responses function tool" in msg
