"""OpenAI's Structured Outputs rules for a schema sent with ``strict: true`` (P1): chat
``response_format.json_schema``, Responses ``text.format`` and a function tool's
``parameters`` (chat ``function.strict``, Responses ``strict``).

OpenAI refuses such a schema with a 400 rather than loosening it: every object must say
``additionalProperties: false`` and list every one of its ``properties`` in ``required``; the
root is an object (not ``anyOf``); and the keywords its strict mode does not support are
refused. Coda answers the same 400, in the same wording (``In context=(...)`` names where in
the schema), so a schema that works here works there. A schema without ``strict`` (or with
``strict: false``) is never checked: it constrains the output as written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from coda.server.http_errors import ApiError

# NOTE: OpenAI's Structured Outputs guide, "Some type-specific keywords are not yet supported"
# and "Composition": refused under strict (pattern, format, minimum/maximum, multipleOf,
# minItems/maxItems, anyOf, enum, const, $ref/$defs are supported)
UNSUPPORTED = (
    "patternProperties", "unevaluatedProperties", "propertyNames", "minProperties",
    "maxProperties", "minLength", "maxLength", "unevaluatedItems", "contains", "minContains",
    "maxContains", "uniqueItems", "allOf", "not", "if", "then", "else", "dependentRequired",
    "dependentSchemas")


def _context(path: tuple[str, ...]) -> str:
    return "(" + ", ".join(repr(p) for p in path) + ("," if len(path) == 1 else "") + ")"


def _is_object(node: Mapping[str, Any]) -> bool:
    kind = node.get("type")
    return (kind == "object" or (isinstance(kind, list) and "object" in kind)
            or "properties" in node)


def _problem(node: Any, path: tuple[str, ...]) -> str | None:
    """The first rule ``node`` (at ``path``) breaks, in OpenAI's words; None: it keeps them."""
    if not isinstance(node, Mapping):
        return None  # NOTE: a boolean schema or junk: the grammar check says what is wrong
    for key in UNSUPPORTED:
        if key in node:
            return f"In context={_context(path)}, '{key}' is not permitted."
    if _is_object(node):
        if node.get("additionalProperties") is not False:
            return (f"In context={_context(path)}, 'additionalProperties' is required to be "
                    "supplied and to be false.")
        props = node.get("properties") or {}
        required = node.get("required")
        listed = required if isinstance(required, list) else []
        missing = [k for k in props if k not in listed] if isinstance(props, Mapping) else []
        if not isinstance(required, list) and props or missing:
            extra = f" Missing '{missing[0]}'." if missing else ""
            return (f"In context={_context(path)}, 'required' is required to be supplied and "
                    f"to be an array including every key in properties.{extra}")
    for key in ("properties", "$defs", "definitions"):
        children = node.get(key)
        if isinstance(children, Mapping):
            for name, child in children.items():
                if (found := _problem(child, (*path, key, str(name)))) is not None:
                    return found
    items = node.get("items")
    if (found := _problem(items, (*path, "items"))) is not None:
        return found
    for key in ("anyOf", "prefixItems"):
        options = node.get(key)
        if isinstance(options, list):
            for i, child in enumerate(options):
                if (found := _problem(child, (*path, key, str(i)))) is not None:
                    return found
    return None


def strict_problem(schema: Any) -> str | None:
    """Why OpenAI's strict mode refuses ``schema`` (its root included); None: it does not."""
    if isinstance(schema, Mapping):
        if "anyOf" in schema and "type" not in schema:
            return "In context=(), 'anyOf' is not permitted at the root of the schema."
        kind = schema.get("type", "object" if "properties" in schema else None)
        if kind != "object":
            return (f"schema must be a JSON Schema of 'type: \"object\"', got "
                    f"'type: \"{kind}\"'.")
    return _problem(schema, ())


def check_strict_format(spec: Mapping[str, object], schema: Any, param: str) -> None:
    """``response_format.json_schema`` / ``text.format`` with ``strict: true``: its schema
    keeps the rules, else OpenAI's 400 naming the format (``Invalid schema for
    response_format 'name': ...``) with ``param`` (chat: ``response_format``)."""
    if spec.get("strict") is not True:
        return
    problem = strict_problem(schema)
    if problem is not None:
        raise ApiError(400, f"Invalid schema for response_format '{spec.get('name')}': "
                       f"{problem}", param=param, code="invalid_json_schema")


def check_strict_tool(tool: Mapping[str, Any], field: str) -> None:
    """A function tool with ``strict: true``: its ``parameters`` keep the rules, else OpenAI's
    400 naming the function (``Invalid schema for function 'name': ...``)."""
    if tool.get("strict") is not True:
        return
    params = tool.get("parameters")
    problem = None if params is None else strict_problem(params)  # NOTE: none: no arguments
    if problem is not None:
        raise ApiError(400, f"Invalid schema for function '{tool.get('name')}': {problem}",
                       param=f"{field}.parameters", code="invalid_function_parameters")
