"""JSON schemas llguidance compiles but cannot answer validly (SPEC P1; docs/api.md
"Structured output that closes within the budget"): each is refused as a 400 naming the
schema's field rather than served with JSON that fails it.

Contract: :func:`schema_problem` is pure (no llguidance, no tokenizer), says why ``schema``
cannot be served, or None; :mod:`coda.engine.grammar` (``response_format``, ``text.format``,
``output_config.format``, Ollama ``format``) and :mod:`coda.server.tools` (a tool's
``parameters`` / ``input_schema``) call it before compiling.

- Open keys: llguidance keeps an object's declared properties distinct but not the keys it
  admits beyond them (``additionalProperties``, ``patternProperties``): ``{"": 0, "": 0}``
  meets ``minProperties: 2`` in the grammar and parses to one property.
- A ``$ref`` with no finite value: a definition that refers to itself before any value is
  written (``{"$ref": "#/$defs/n"}`` as ``n``, two definitions naming each other, an
  ``allOf`` of itself) or whose every value must contain another of itself (a required
  property, or ``minItems`` items, of its own kind). llguidance compiles it all the same, and
  the output reaches a point where no token continues it: the request then ended there, a
  natural ``stop`` with ``{"a":`` or nothing at all as its "JSON". Only local refs (``#...``)
  are followed; a subschema this reads no requirement from (no fixed ``type``, another
  keyword) counts as having a value, so what is refused surely has none.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

__all__ = ["open_keys_problem", "schema_problem"]

# NOTE: values that are data, not subschemas
_DATA_KEYS = frozenset({"enum", "const", "default", "examples"})


def schema_problem(schema: Any) -> str | None:
    """Why llguidance cannot keep ``schema``'s outputs valid, or None (module contract)."""
    return open_keys_problem(schema) or _endless_ref_problem(schema)


def open_keys_problem(schema: Any) -> str | None:
    """A minProperties above the required properties, where other keys are admitted, or None
    (module contract: llguidance cannot keep those keys distinct)."""
    if isinstance(schema, list):
        return next((p for p in map(open_keys_problem, schema) if p), None)
    if not isinstance(schema, dict):
        return None
    need, required = schema.get("minProperties"), schema.get("required")
    count = len(required) if isinstance(required, list) else 0
    if (isinstance(need, int) and need > count and (
            schema.get("additionalProperties", True) is not False
            or "patternProperties" in schema)):
        return (f"minProperties ({need}) above the {count} required properties is not "
                "supported where additionalProperties / patternProperties admit other keys: "
                "the grammar cannot keep those keys distinct")
    return next((p for k, v in schema.items() if k not in _DATA_KEYS
                 for p in (open_keys_problem(v),) if p), None)


def _local_refs(node: Any, found: set[str]) -> set[str]:
    """Every local ``$ref`` string in ``node``'s subschemas."""
    if isinstance(node, list):
        for item in node:
            _local_refs(item, found)
    elif isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            found.add(ref)
        for key, value in node.items():
            if key not in _DATA_KEYS:
                _local_refs(value, found)
    return found


_UNRESOLVED = object()


def _resolve(root: Any, ref: str) -> Any:
    """The subschema a local JSON pointer ``#/a/b`` names in ``root``, or _UNRESOLVED (an
    anchor, ``#name``, too: llguidance's to resolve or refuse)."""
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return _UNRESOLVED
    node = root
    for raw in pointer.split("/")[1:]:
        part = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _UNRESOLVED
    return node


def _has_value(node: Any, done: set[str]) -> bool:
    """False only where every value ``node`` admits needs a ref not (yet) in ``done``."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and ref not in done:
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(
                _has_value(b, done) for b in branches):
            return False
    every = node.get("allOf")
    if isinstance(every, list) and not all(_has_value(s, done) for s in every):
        return False
    kind = node.get("type")
    if kind == "object":
        props, required = node.get("properties"), node.get("required")
        if isinstance(props, dict) and isinstance(required, list) and not all(
                _has_value(props[k], done) for k in required if isinstance(k, str) and k in props):
            return False
    if kind == "array":
        least = node.get("minItems")
        prefix = node.get("prefixItems", node.get("items"))
        prefix = prefix if isinstance(prefix, list) else []
        rest = node.get("items") if isinstance(node.get("items"), (dict, bool)) else True
        # NOTE: the first minItems items: the tuple's own schemas, then `items`
        if isinstance(least, int) and not all(
                _has_value(prefix[i] if i < len(prefix) else rest, done)
                for i in range(min(least, len(prefix) + 1))):
            return False
    return True


def _endless_ref_problem(schema: Any) -> str | None:
    """A local ``$ref`` whose subschema has no finite value, or None (module contract): the
    least fixed point of "has a value", as a grammar's productive symbols are found."""
    refs = _local_refs(schema, set())
    done = {r for r in refs if _resolve(schema, r) is _UNRESOLVED}  # NOTE: llguidance's 400
    grew = True
    while grew:
        grew = False
        for ref in sorted(refs - done):
            if _has_value(_resolve(schema, ref), done):
                done.add(ref)
                grew = True
    endless = sorted(refs - done)
    if not endless:
        return None
    return (f"$ref {endless[0]!r} admits no finite JSON value: every value it allows refers "
            "to itself again before it can end (a $ref cycle with no way out)")
