"""The closing walk leaves a loop the grammar could repeat forever (issue 13 item 2; SPEC L4).

The greedy walk takes the first byte the grammar allows in a fixed order; where that byte can
repeat without end (`^[0-9]+x$`: `0` forever, never `x`; an email's local part) it found no
completion, so closure was silently off and a tight `max_tokens` cut the output mid-string
(invalid JSON, `max_output_tokens`). Now such a run is cut back and the walk prefers the bytes
it has used least, so it reaches the end: the bound exists, `max_tokens` below it is a 400,
and admitted output validates.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import llguidance as llg
import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from coda.engine.async_engine import DEFAULT_MODEL_DIR, AsyncEngine
from coda.engine.closure_walk import byte_table, closing_path
from coda.engine.grammar import grammar_source
from coda.engine.grammar_tokenizer import ll_tokenizer
from coda.engine.types import EngineConfig, GenerationRequest, GrammarSpec
from coda.errors import InvalidRequestError
from coda.finish import FinishReason
from coda.sampling import SamplingParams

_TOK = tokenizers.Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
_LL = ll_tokenizer(_TOK, frozenset({0, 2}))
LOOPS: dict[str, dict[str, Any]] = {
    "digits then x": {"type": "string", "pattern": "^[0-9]+x$"},
    "a+b": {"type": "string", "pattern": "^a+b$"},
    "email": {"type": "string", "format": "email"},
    "object with email": {"type": "object", "required": ["e"], "additionalProperties": False,
                          "properties": {"e": {"type": "string", "format": "email"}}},
}


def _matcher(schema: dict[str, Any]) -> llg.LLMatcher:
    return llg.LLMatcher(_LL, grammar_source(GrammarSpec(json_schema=schema)), log_level=0)


@pytest.mark.parametrize("name", list(LOOPS))
def test_l4_walk_out_of_a_repeatable_byte_finds_a_completion(name: str) -> None:
    """From the start, a completion exists, the grammar accepts it and it validates."""
    schema = LOOPS[name]
    m = _matcher(schema)
    path = closing_path(m, _LL, byte_table(_LL))
    assert path is not None, name
    assert len(path.text) < 200, path.text  # NOTE: the run is cut back, not kept
    assert m.consume_tokens(list(path.tokens)) is not False and m.is_accepting()
    jsonschema.validate(json.loads(path.text), schema)


@settings(max_examples=40, deadline=None)
@given(digits=st.text(alphabet="0123456789", max_size=40))
def test_l4_every_prefix_of_a_looping_pattern_closes(digits: str) -> None:
    """For all prefixes `"<digits>` of `^[0-9]+x$`, the walk finds a completion that the
    grammar accepts and that validates."""
    schema = LOOPS["digits then x"]
    m = _matcher(schema)
    prefix = _TOK.encode('"' + digits, add_special_tokens=False).ids
    if m.consume_tokens(prefix) is False or m.is_error():
        return  # NOTE: a split the grammar's lexer refuses; not this property
    path = closing_path(m, _LL, byte_table(_LL))
    assert path is not None
    assert m.consume_tokens(list(path.tokens)) is not False and m.is_accepting()
    jsonschema.validate(json.loads('"' + digits + path.text.decode()), schema)


def test_l4_plain_walks_are_unchanged() -> None:
    """A walk with no long run is the greedy one as before (closing quotes first)."""
    m = _matcher({"type": "object", "required": ["n"], "additionalProperties": False,
                  "properties": {"n": {"type": "string"}}})
    assert m.consume_tokens(_TOK.encode('{"n":"ab', add_special_tokens=False).ids)
    path = closing_path(m, _LL, byte_table(_LL))
    assert path is not None and path.text == b'"}'


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    with AsyncEngine.from_model_dir(None, EngineConfig(max_num_seqs=8)) as eng:
        yield eng


def test_l4_email_field_refuses_a_budget_below_the_bound_and_closes_within_one(
        engine: AsyncEngine) -> None:
    """max_tokens 1 is a 400 naming max_tokens (it was admitted, closure silently off); a
    tight budget gives output that validates, every ending FINISHED."""
    schema = LOOPS["object with email"]
    ids = tuple(engine.tokenizer.encode("Email as JSON:", add_special_tokens=False).ids)
    with pytest.raises(InvalidRequestError) as err:
        engine.submit(GenerationRequest(ids, max_tokens=1,
                                        grammar=GrammarSpec(json_schema=schema)))
    assert err.value.field == "max_tokens"
    handles = [engine.submit(GenerationRequest(
        ids, SamplingParams(temperature=1.0, seed=s), max_tokens=60,
        grammar=GrammarSpec(json_schema=schema))) for s in range(4)]
    for h in handles:
        t = h.wait(120)
        assert t.finish_reason in (FinishReason.GRAMMAR_FORCED_CLOSE,
                                   FinishReason.GRAMMAR_COMPLETE), t.finish_reason
        jsonschema.validate(json.loads(h.stream.text()), schema)


def test_l4_loop_inside_an_open_object_stays_short() -> None:
    """The least-used preference ends with the string that looped: an email inside an object
    that allows more properties closes right after it, not after a tour of new properties
    (its bound was over a thousand tokens, refusing every usual max_tokens)."""
    schema = {"type": "object", "required": ["e"],
              "properties": {"e": {"type": "string", "format": "email"}}}
    m = _matcher(schema)
    path = closing_path(m, _LL, byte_table(_LL))
    assert path is not None and len(path.text) < 100, path
    assert path.text.endswith(b'"}'), path.text
    jsonschema.validate(json.loads(path.text), schema)


@pytest.mark.parametrize("depth", [8, 9, 16])
def test_l4_deep_nesting_still_closes_by_its_brackets(depth: int) -> None:
    """A run of closing brackets outside text closes levels, it is no loop: arrays nested
    `depth` deep (each needing one item) close as `[[...0]...]`, as before the loop rule."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "minItems": 1}
    m = _matcher(schema)
    path = closing_path(m, _LL, byte_table(_LL))
    assert path is not None
    assert path.text == b"[" * depth + b"0" + b"]" * depth
    assert m.consume_tokens(list(path.tokens)) is not False and m.is_accepting()
