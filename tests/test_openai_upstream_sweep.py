"""Chat Completions and Responses answer what OpenAI answers for the same request (SPEC P1),
through the official ``openai`` client over loopback on SmolLM2 and Gemma 3 270M (GGUF,
SentencePiece; skipped where ``/tmp/gemma3-270m-q4_k_m.gguf`` is absent). Found by sweeping
both models with the client (the tool findings: test_openai_upstream_tools.py):

- ``response_format: {"type": "json_schema", "json_schema": {"schema": ...}}`` without a
  ``name`` (or with ``"a b"``) was served; OpenAI requires the name (``^[a-zA-Z0-9_-]{1,64}$``):
  a 400 naming ``response_format.json_schema.name`` (Responses: ``text.format.name``). So
  were ``"strict": "yes"``, ``"description": 5`` and an unknown key beside ``schema``.
- Responses ``text: {"verbosity": "low"}`` was a 400 ("Unrecognized request argument");
  OpenAI accepts low / medium / high and echoes it in the response's ``text``.
- An explicit ``null`` for a field OpenAI declares nullable (chat ``n``, ``stream``,
  ``logprobs``; completions ``echo``; Responses ``store``, ``stream``, ``background``) was a
  400 ("Input should be a valid boolean"); the official SDK sends null for ``n=None``.
- ``top_p: 0`` was a 400 ("greater than 0"); OpenAI's range is [0, 1] (its OpenAPI
  description: ``minimum: 0``), 0 keeping the best token alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.openai_sweep_support import MODELS, SCHEMA, U, serve
from tests.openai_sweep_support import bad as _bad
from tests.openai_sweep_support import model_of as _model


@pytest.fixture(scope="module", params=MODELS)
def oa(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    yield from serve(request.param)


@pytest.mark.parametrize("name", [None, "a b", "a.b", "", "x" * 65])
def test_p1_json_schema_format_needs_a_valid_name(oa: openai.OpenAI, name: str | None) -> None:
    """P1: a json_schema format without a name, or one outside ``^[a-zA-Z0-9_-]{1,64}$``, is
    a 400 naming the name's field, on chat and Responses (streamed too); a valid one
    constrains the output as before."""
    m = _model(oa)
    spec: Any = {"schema": SCHEMA} if name is None else {"name": name, "schema": SCHEMA}
    for stream in (False, True):
        _bad(lambda s=stream: oa.chat.completions.create(
            model=m, messages=U, max_tokens=8, stream=s,
            response_format={"type": "json_schema", "json_schema": spec}),
            "response_format.json_schema.name")
        _bad(lambda s=stream: oa.responses.create(
            model=m, input="hi", max_output_tokens=16, stream=s,
            text={"format": {"type": "json_schema", **spec}}), "text.format.name")
    ok = oa.chat.completions.create(model=m, messages=U, max_tokens=16, seed=1,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "A-b_9", "schema": SCHEMA}})
    assert ok.choices[0].message.content and ok.choices[0].message.content.startswith('{"a":')
    rs = oa.responses.create(model=m, input="hi", max_output_tokens=16, extra_body={"seed": 1},
                             text={"format": {"type": "json_schema", "name": "x" * 64,
                                              "schema": SCHEMA}})
    assert rs.output_text.startswith('{"a":') and rs.text.format.name == "x" * 64  # type: ignore


@pytest.mark.parametrize("key,value", [("strict", "yes"), ("description", 5), ("bogus", 1)])
def test_p1_json_schema_format_fields_are_checked(oa: openai.OpenAI, key: str,
                                                  value: Any) -> None:
    """P1: in a json_schema format ``strict`` is a boolean, ``description`` a string, and no
    other key is accepted: a 400 naming ``response_format.json_schema.<key>`` (Responses:
    ``text.format.<key>``); ``strict: true`` with a ``description`` is served."""
    m = _model(oa)
    spec: Any = {"name": "r", "schema": SCHEMA, key: value}
    _bad(lambda: oa.chat.completions.create(
        model=m, messages=U, max_tokens=8,
        response_format={"type": "json_schema", "json_schema": spec}),
        f"response_format.json_schema.{key}")
    _bad(lambda: oa.responses.create(model=m, input="hi", max_output_tokens=16,
                                     text={"format": {"type": "json_schema", **spec}}),
         f"text.format.{key}")
    good: Any = {"name": "r", "schema": SCHEMA, "strict": True, "description": "a record"}
    ok = oa.chat.completions.create(model=m, messages=U, max_tokens=16, seed=1,
                                    response_format={"type": "json_schema", "json_schema": good})
    assert str(ok.choices[0].message.content).startswith('{"a":')
    rs = oa.responses.create(model=m, input="hi", max_output_tokens=16,
                             text={"format": {"type": "json_schema", **good}})
    assert rs.output_text.startswith('{"a":')


def test_p1_responses_text_verbosity_is_accepted_and_echoed(oa: openai.OpenAI) -> None:
    """P1: ``text.verbosity`` low / medium / high is accepted and echoed in the response's
    ``text`` (create, the stream's created event, retrieve); not sent it reads ``medium``,
    OpenAI's default; another value is a 400 naming ``text.verbosity``. Chat's top-level
    ``verbosity`` is accepted the same way."""
    m = _model(oa)
    plain = oa.responses.create(model=m, input="hi", max_output_tokens=16)
    assert plain.text.verbosity == "medium"
    low = oa.responses.create(model=m, input="hi", max_output_tokens=16,
                              text={"verbosity": "low"})
    assert low.text.verbosity == "low" and low.text.format.type == "text"  # type: ignore
    assert oa.responses.retrieve(low.id).text.verbosity == "low"
    events = list(oa.responses.create(model=m, input="hi, as json", max_output_tokens=16,
                                      stream=True, text={"verbosity": "high",
                                                         "format": {"type": "json_object"}}))
    first: Any = events[0]
    assert first.response.text.verbosity == "high"
    assert first.response.text.format.type == "json_object"
    _bad(lambda: oa.responses.create(model=m, input="hi", max_output_tokens=16,
                                     text={"verbosity": "loud"}),  # type: ignore[typeddict-item]
         "text.verbosity")
    chat = oa.chat.completions.create(model=m, messages=U, max_tokens=2, verbosity="low")
    assert chat.choices[0].finish_reason in ("length", "stop")
    _bad(lambda: oa.chat.completions.create(model=m, messages=U, max_tokens=2,
                                            verbosity="loud"),  # type: ignore[arg-type]
         "verbosity")


def test_p1_top_p_zero_keeps_the_best_token_alone(oa: openai.OpenAI) -> None:
    """P1: ``top_p: 0`` is accepted on chat, completions and Responses (OpenAI's range is
    [0, 1]) and keeps only the best token: at temperature 1 the output equals the greedy one
    (temperature 0), for every seed; Responses echoes ``top_p: 0``; -0.1 is still a 400."""
    m = _model(oa)
    ask: Any = [{"role": "user", "content": "Tell me a story"}]
    greedy = oa.chat.completions.create(model=m, messages=ask, max_tokens=16, temperature=0)
    for seed in (1, 2):
        got = oa.chat.completions.create(model=m, messages=ask, max_tokens=16, top_p=0,
                                         temperature=1.0, seed=seed)
        assert got.choices[0].message.content == greedy.choices[0].message.content
    plain = oa.completions.create(model=m, prompt="Once upon a time", max_tokens=8,
                                  temperature=0)
    nucleus = oa.completions.create(model=m, prompt="Once upon a time", max_tokens=8,
                                    top_p=0, seed=3)
    assert nucleus.choices[0].text == plain.choices[0].text
    rs = oa.responses.create(model=m, input="Tell me a story", max_output_tokens=16, top_p=0)
    assert rs.top_p == 0 and rs.output_text == greedy.choices[0].message.content
    _bad(lambda: oa.chat.completions.create(model=m, messages=ask, max_tokens=2, top_p=-0.1),
         "top_p")


def test_p1_null_for_a_nullable_field_is_its_default(oa: openai.OpenAI) -> None:
    """P1: the client passing None (sent as JSON null) for OpenAI's nullable ``n``,
    ``stream``, ``logprobs``, ``store`` (chat), ``echo`` (completions), ``store``, ``stream``,
    ``background`` (Responses) gets each field's default: one choice, no stream, no
    logprobs, no echo, a stored response answered in the foreground."""
    m = _model(oa)
    r = oa.chat.completions.create(model=m, messages=U, max_tokens=2, n=None, stream=None,
                                   logprobs=None, store=None)
    assert len(r.choices) == 1 and r.choices[0].logprobs is None
    c = oa.completions.create(model=m, prompt="Once upon", max_tokens=2, n=None, stream=None,
                              echo=None, temperature=0)
    plain = oa.completions.create(model=m, prompt="Once upon", max_tokens=2, temperature=0)
    assert len(c.choices) == 1 and c.choices[0].text == plain.choices[0].text
    rs = oa.responses.create(model=m, input="hi", max_output_tokens=16, stream=None,
                             store=None, background=None)
    assert rs.status != "queued" and rs.store is True and rs.background is False
    assert oa.responses.retrieve(rs.id).id == rs.id
