"""Which JSON schemas Coda refuses before compiling a grammar (SPEC P1: a 400 naming the
field, never a generation the grammar cannot finish honestly): ``schema_problem``'s two rules,
case by case (coda/engine/grammar_schema.py). The HTTP side is tests/test_schema_no_value.py."""
from __future__ import annotations

from typing import Any

import pytest

from coda.engine.grammar_schema import open_keys_problem, schema_problem


def _ref(defs: dict[str, Any], name: str) -> dict[str, Any]:
    return {"$defs": defs, "$ref": f"#/$defs/{name}"}


def _obj(props: dict[str, Any], required: list[Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": required}


SELF = {"$ref": "#/$defs/n"}

# NOTE: a $ref whose every value needs itself again: refused
ENDLESS: dict[str, Any] = {
    "a required false property": _ref({"n": _obj({"x": False}, ["x"])}, "n"),
    "anyOf of only itself": _ref({"n": {"anyOf": [SELF, SELF]}}, "n"),
    "oneOf of only itself": _ref({"n": {"oneOf": [SELF]}}, "n"),
    "a list element naming itself": _ref({"xs": [{"$ref": "#/$defs/xs/0"}]}, "xs/0"),
    "a ref inside a list of branches": {"$defs": {"n": {"allOf": [SELF]}},
                                        "anyOf": [SELF]},
}

# NOTE: schemas with a finite value: served (the grammar's to compile)
FINITE: dict[str, Any] = {
    "a required true property": _ref({"n": _obj({"x": True, "y": SELF}, ["x"])}, "n"),
    "a required key without a property schema": _ref(
        {"n": _obj({"x": SELF}, ["y"])}, "n"),
    "a tuple then any items": _ref(
        {"n": {"type": "array", "prefixItems": [{"type": "integer"}], "minItems": 2,
               "x": SELF}}, "n"),
    "a ref needing a later ref": _ref(
        {"a": _obj({"b": {"$ref": "#/$defs/b"}}, ["b"]), "b": {"type": "integer"}}, "a"),
    "a list index past the end": {"$defs": {"xs": [{"type": "integer"}]},
                                  "$ref": "#/$defs/xs/1"},
    "a digit key of an object that lacks it": {"$defs": {"a": {}, "b": {}},
                                               "$ref": "#/$defs/1"},
    "a list element with a value": _ref({"xs": [{"type": "integer"}]}, "xs/0"),
}


@pytest.mark.parametrize("name", sorted(ENDLESS))
def test_p1_a_ref_with_no_finite_value_is_refused(name: str) -> None:
    problem = schema_problem(ENDLESS[name])
    assert problem is not None and "admits no finite JSON value" in problem


@pytest.mark.parametrize("name", sorted(FINITE))
def test_p1_a_ref_with_a_finite_value_is_served(name: str) -> None:
    assert schema_problem(FINITE[name]) is None


OPEN = {"type": "object", "minProperties": 2, "required": ["a"]}


@pytest.mark.parametrize("schema", [
    OPEN,
    {**OPEN, "additionalProperties": False, "patternProperties": {"^x": {}}},
    {"minProperties": 1},
    [{"type": "string"}, OPEN],
    {"properties": {"inner": OPEN}},
])
def test_p1_min_properties_above_the_required_with_other_keys_is_refused(schema: Any) -> None:
    problem = open_keys_problem(schema)
    assert problem is not None and "minProperties (" in problem
    assert schema_problem(schema) == problem


@pytest.mark.parametrize("schema", [
    {**OPEN, "additionalProperties": False},
    {**OPEN, "minProperties": 1},
    {"type": "object", "minProperties": 1, "required": ["a", "b"]},
    {"enum": [OPEN], "const": OPEN, "examples": [OPEN], "default": OPEN},
    "a string", 3, [{"type": "string"}],
])
def test_p1_min_properties_the_grammar_can_keep_is_served(schema: Any) -> None:
    assert open_keys_problem(schema) is None
