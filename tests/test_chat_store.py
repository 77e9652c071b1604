"""Stored chat completions and strict Structured Outputs schemas answer as OpenAI's (SPEC P1,
P3), through the official ``openai`` client over loopback on SmolLM2:

- ``client.chat.completions.retrieve(id)`` of a ``store: true`` completion was a 404 (no such
  route); so were ``.list``, ``.update``, ``.delete`` and ``.messages.list``. Now a stored
  completion (streamed or not) is retrieved as created, listed (``model``, ``metadata``,
  ``after``, ``limit``, ``order``), its metadata replaced, its request messages listed, and
  deleted; an unstored one is a 404.
- ``response_format`` ``json_schema`` with ``strict: true`` and a schema OpenAI's strict mode
  refuses (an object without ``additionalProperties: false``, a property not in ``required``,
  ``minLength``) was served; OpenAI answers a 400 naming ``response_format``. So for a
  function tool with ``strict: true``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.openai_sweep_support import SCHEMA, U, serve
from tests.openai_sweep_support import model_of as _model


@pytest.fixture(scope="module")
def oa() -> Iterator[openai.OpenAI]:
    yield from serve("smollm2")


def _missing(call: Any) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        call()
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error" and body["code"] == "not_found", body


def test_p1_stored_chat_completion_is_retrieved_updated_listed_and_deleted(
        oa: openai.OpenAI) -> None:
    """P1: a ``store: true`` completion is retrieved exactly as created (plus its metadata),
    its metadata replaced by update, listed by model / metadata with cursor paging, its
    request messages listed with ids, and deleted (then a 404 everywhere)."""
    m = _model(oa)
    msgs: Any = [{"role": "system", "content": "Be brief."},
                 {"role": "user", "content": [{"type": "text", "text": "Say "},
                                              {"type": "text", "text": "hi"}]}]
    made = oa.chat.completions.create(model=m, messages=msgs, max_tokens=8, seed=1,
                                      store=True, metadata={"run": "a", "k": "1"})
    got = oa.chat.completions.retrieve(made.id)
    assert got.id == made.id and got.object == "chat.completion"
    assert got.choices[0].message.content == made.choices[0].message.content
    assert got.usage == made.usage and got.created == made.created
    assert got.metadata == {"run": "a", "k": "1"}
    msg_page = oa.chat.completions.messages.list(made.id)
    assert [x.role for x in msg_page.data] == ["system", "user"]
    assert msg_page.data[0].id == f"{made.id}-0" and msg_page.data[0].content == "Be brief."
    assert msg_page.data[1].content == "Say hi"
    assert msg_page.data[1].content_parts is not None
    assert oa.chat.completions.messages.list(made.id, order="desc").data[0].role == "user"
    second = oa.chat.completions.create(model=m, messages=U, max_tokens=4, store=True,
                                        metadata={"run": "b"})
    oa.chat.completions.create(model=m, messages=U, max_tokens=4)  # NOTE: not stored
    ids = [c.id for c in oa.chat.completions.list(model=m)]
    assert made.id in ids and second.id in ids and ids.index(made.id) < ids.index(second.id)
    only = oa.chat.completions.list(metadata={"run": "b"})
    assert [c.id for c in only.data] == [second.id] and not only.has_more
    one = oa.chat.completions.list(limit=1, order="desc")
    assert one.has_more and len(one.data) == 1
    assert [c.id for c in oa.chat.completions.list(model="no-such-model")] == []
    updated = oa.chat.completions.update(made.id, metadata={"run": "c"})
    assert updated.metadata == {"run": "c"}
    assert [c.id for c in oa.chat.completions.list(metadata={"run": "c"})] == [made.id]
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.update(made.id, metadata={f"k{i}": "v" for i in range(17)})
    assert exc.value.body["param"] == "metadata"  # type: ignore[index]
    gone = oa.chat.completions.delete(made.id)
    assert gone.deleted and gone.id == made.id and gone.object == "chat.completion.deleted"
    _missing(lambda: oa.chat.completions.retrieve(made.id))
    _missing(lambda: oa.chat.completions.messages.list(made.id))
    _missing(lambda: oa.chat.completions.delete(made.id))
    assert made.id not in [c.id for c in oa.chat.completions.list(model=m)]


def test_p1_p3_streamed_store_is_assembled_and_unstored_is_404(oa: openai.OpenAI) -> None:
    """P1, P3: a streamed ``store: true`` completion is retrieved assembled (its text the
    deltas joined, usage included); without ``store: true`` (omitted or false) a retrieve is
    OpenAI's 404."""
    m = _model(oa)
    chunks = list(oa.chat.completions.create(model=m, messages=U, max_tokens=8, seed=2,
                                             store=True, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    got = oa.chat.completions.retrieve(chunks[0].id)
    assert got.choices[0].message.content == text and text
    assert got.usage is not None and got.usage.completion_tokens >= 1
    for store in (None, False):
        plain = oa.chat.completions.create(model=m, messages=U, max_tokens=2,
                                           **({} if store is None else {"store": store}))
        _missing(lambda: oa.chat.completions.retrieve(plain.id))  # noqa: B023
        _missing(lambda: oa.chat.completions.update(plain.id, metadata={}))  # noqa: B023
    _missing(lambda: oa.chat.completions.retrieve("chatcmpl-nope"))


LOOSE: Any = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
PARTIAL: Any = {"type": "object", "properties": {"a": {"type": "integer"},
                                                 "b": {"type": "string"}},
                "required": ["a"], "additionalProperties": False}
MIN_LENGTH: Any = {"type": "object", "properties": {"s": {"type": "string", "minLength": 2}},
                   "required": ["s"], "additionalProperties": False}


@pytest.mark.parametrize("schema,words", [
    (LOOSE, "'additionalProperties' is required to be supplied and to be false"),
    (PARTIAL, "Missing 'b'"),
    (MIN_LENGTH, "In context=('properties', 's'), 'minLength' is not permitted"),
])
def test_p1_strict_schema_breaking_openai_rules_is_a_400(oa: openai.OpenAI, schema: Any,
                                                         words: str) -> None:
    """P1: ``strict: true`` with a schema OpenAI's strict mode refuses is a 400
    ``invalid_request_error`` naming ``response_format`` (a strict function tool: its
    parameters; Responses ``text.format``: ``text.format.schema``), in OpenAI's wording; the
    same schema without ``strict`` is served."""
    m = _model(oa)
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema,
                                                       "strict": True}}
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=m, messages=U, max_tokens=8, response_format=fmt)
    body: Any = exc.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == "response_format"
    assert body["message"].startswith("Invalid schema for response_format 'r': ")
    assert words in body["message"], body
    tool: Any = [{"type": "function", "function": {"name": "f", "parameters": schema,
                                                   "strict": True}}]
    with pytest.raises(openai.BadRequestError) as exc:
        oa.chat.completions.create(model=m, messages=U, max_tokens=8, tools=tool)
    body = exc.value.body
    assert body["param"] == "tools.0.function.parameters" and words in body["message"], body
    assert body["message"].startswith("Invalid schema for function 'f': ")
    with pytest.raises(openai.BadRequestError) as exc:  # NOTE: Responses' text.format too
        oa.responses.create(model=m, input="hi", max_output_tokens=16, text={"format": {
            "type": "json_schema", "name": "r", "schema": schema, "strict": True}})
    body = exc.value.body
    assert body["param"] == "text.format.schema" and words in body["message"], body
    loose: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
    ok = oa.chat.completions.create(model=m, messages=U, max_tokens=8, response_format=loose)
    assert ok.choices[0].message.content
    strict: Any = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA,
                                                          "strict": True}}
    good = oa.chat.completions.create(model=m, messages=U, max_tokens=16, seed=1,
                                      response_format=strict)
    assert str(good.choices[0].message.content).startswith('{"a":')
